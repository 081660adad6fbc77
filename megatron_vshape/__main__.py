"""``python -m megatron_vshape`` is the ``vshape`` command."""
from .cli import main

raise SystemExit(main())
