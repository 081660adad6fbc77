"""The main job (``vshape demo``): a tiny megatron-core GPT on gloo under every schedule."""
import json

import pytest

pytest.importorskip("megatron.core")

from megatron_vshape.cli import main  # noqa: E402


def test_demo_trains_the_same_model_under_every_schedule(tmp_path, capsys):
    """p = 2 keeps it short; every schedule's losses and gradients must equal megatron's own
    1F1B (fp32, 1e-5; they come out bit-identical), auto must re-plan, pictures are written."""
    code = main(["demo", "-p", "2", "-m", "4", "--steps", "2", "-o", str(tmp_path), "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [r["schedule"] for r in rows] == ["1f1b", "zb-1p", "v-min", "v-half", "v-zb", "auto"]
    for row in rows:
        assert row["max_loss_diff"] < 1e-5 and row["max_grad_diff"] < 1e-5, row["schedule"]
        assert len(row["peak_activation_bytes"]) == 2 and min(row["peak_activation_bytes"]) > 0
        # measured memory tracks the simulator's ratio (rank 0 also keeps logits and loss)
        assert row["peak_activation_vs_1f1b"] <= row["simulated_peak_vs_1f1b"] + 0.1
        assert 0 <= row["simulated_bubble"] < 1 and row["step_time_s"] > 0
    auto = rows[-1]
    assert len(auto["plans"]) == 2  # provisional, then re-planned from measured costs
    for name in ("1f1b", "v-half", "auto"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    assert json.loads((tmp_path / "demo.json").read_text()) == rows


@pytest.mark.parametrize("argv,needle", [
    (["--schedules", "v-quarter"], "--schedules: ['v-quarter'] unknown; valid choices: 1f1b"),
    (["--memory-limit", "lots"], "--memory-limit must be a number with a unit"),
    (["--ranks", "1"], "--ranks must be >= 2"),
    (["--ranks", "8"], "lower --ranks"),
])
def test_demo_bad_settings_fail_before_any_work(argv, needle, capsys):
    assert main(["demo", *argv]) == 2
    assert needle in capsys.readouterr().err
