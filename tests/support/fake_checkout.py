"""A repository copy the Slurm launchers run end to end in, without GPUs or Megatron-LM: the
launcher tests of tests/experiments and tests/cli share it."""
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"


def fake_checkout(tmp_path) -> dict:
    """A repository copy with a stand-in training script, a Megatron-LM stand-in, and a
    torchrun that only prints its arguments: the launchers run end to end without GPUs."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copytree(SLURM, repo / "scripts" / "slurm")
    (repo / "scripts" / "pretrain_gpt_vshape.py").write_text("# stand-in\n")
    megatron = tmp_path / "Megatron-LM"
    megatron.mkdir()
    (megatron / "pretrain_gpt.py").write_text("# stand-in\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {"torchrun": 'echo "TORCHRUN $*"\n', "srun": 'echo "SRUN $*"\n',
             "scontrol": 'printf "node-a\\nnode-b\\n"\n'}
    for name, body in stubs.items():
        (bin_ / name).write_text("#!/bin/bash\n" + body)
        (bin_ / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NODE_RANK"))}
    env.update(PATH=f"{bin_}:{env['PATH']}", MEGATRON_LM=str(megatron), DATA_PATH="mock",
               LOG_DIR=str(tmp_path / "logs"), VSHAPE_ROOT=str(repo))
    for key in ("VOCAB_FILE", "MERGE_FILE", "TOKENIZER_MODEL", "CHECKPOINT_DIR", "CONTAINER",
                "NNODES", "GPUS_PER_NODE", "RUN_NAME"):
        env.pop(key, None)
    return {"repo": repo, "env": env}
