"""The bundled model, grid and profile files, found by bare name from any folder (tier 1).

``megatron_vshape.configs.find_config`` is the one lookup behind ``--model``, ``--profile``, a
grid's ``model:`` and ``vshape grid`` / ``paper``; that the files ship in a wheel is checked in
test_packaging.py.
"""
import pytest

from megatron_vshape.cli import main
from megatron_vshape.configs import CONFIG_DIR, KINDS, config_names, find_config
from megatron_vshape.experiments import load_grid
from megatron_vshape.plan import load_model_config
from megatron_vshape.plan.profile_file import load_profile


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The current folder is an empty one outside the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_kind_has_its_bundled_files():
    assert config_names("models") == ("gemma-2-9b", "gpt-21b", "gpt-38.5b", "gpt-9.6b",
                                      "gpt-98.5b", "llama-3-70b", "llama-3-8b", "moe-64e-top6", "moe-8x7b",
                                      "qwen2.5-72b", "qwen2.5-7b", "small", "tiny")
    assert config_names("grid") == ("gpt-21b", "gpt-38.5b", "gpt-9.6b", "gpt-98.5b")
    gpu = tuple(f"cuda-{m}-s{s}" for m in ("gpt-21b", "gpt-38.5b", "gpt-9.6b", "gpt-98.5b")
                for s in (1024, 3072))
    assert config_names("profiles") == ("cpu-small", "cpu-tiny") + gpu
    assert set(KINDS) == {"models", "grid", "profiles"}


@pytest.mark.parametrize("kind", ["models", "grid", "profiles"])
def test_bare_names_resolve_from_another_folder(kind, elsewhere):
    for name in config_names(kind):
        expected = CONFIG_DIR / kind / f"{name}.yaml"
        assert find_config(kind, name) == expected
        assert find_config(kind, f"{name}.yaml") == expected


def test_loaders_take_bare_names(elsewhere):
    assert load_model_config("gpt-9.6b") == load_model_config(CONFIG_DIR / "models/gpt-9.6b.yaml")
    assert load_model_config("gpt-9.6b").num_layers == 30
    assert load_grid("gpt-9.6b").model.name == "gpt-9.6b"
    assert load_profile("cpu-small").seq_length == 2048


def test_a_path_wins_over_a_bundled_name(elsewhere):
    """A file the user points at is read, even where its name is a bundled one's."""
    bundled = (CONFIG_DIR / "models/tiny.yaml").read_text()
    assert "num_layers: 8\n" in bundled
    local = elsewhere / "tiny.yaml"
    local.write_text(bundled.replace("num_layers: 8\n", "num_layers: 4\n"))
    assert find_config("models", "tiny.yaml").resolve() == local
    assert load_model_config("tiny.yaml").num_layers == 4
    assert load_model_config("tiny").num_layers == 8  # no suffix, no file: the bundled one
    (elsewhere / "sub").mkdir()
    assert load_model_config("sub/../tiny.yaml").num_layers == 4


def test_a_grid_names_its_model_by_path_or_by_name(elsewhere):
    text = (CONFIG_DIR / "grid/gpt-9.6b.yaml").read_text()
    assert "model: ../models/gpt-9.6b.yaml\n" in text
    by_name = elsewhere / "mine.yaml"
    by_name.write_text(text.replace("model: ../models/gpt-9.6b.yaml", "model: gpt-21b"))
    assert load_grid(by_name).model.name == "gpt-21b"
    moved = elsewhere / "moved.yaml"  # a relative model path is the grid file's, not the cwd's
    moved.write_text(text)
    with pytest.raises(ValueError, match=r"model: model config .*models/gpt-9\.6b\.yaml"):
        load_grid(moved)


def test_the_cli_takes_bare_names_from_another_folder(elsewhere, capsys):
    assert main(["plan", "--model", "small", "--gpus", "8", "--gpu-memory", "80", "--top", "1",
                 "--profile", "cpu-small", "--seq-length", "2048", "--schedules", "1f1b",
                 "v-half", "--recompute", "none"]) == 0
    assert "tok/s/GPU" in capsys.readouterr().out
    assert main(["grid", "gpt-9.6b", "--dry-run"]) == 0
    assert "grid gpt-9.6b (gpt-9.6b): model gpt-9.6b (30 layers" in capsys.readouterr().out
    assert list(elsewhere.iterdir()) == []  # --dry-run wrote nothing


@pytest.mark.parametrize("argv, kind", [
    (["plan", "--model", "gpt-9b", "--gpus", "8", "--gpu-memory", "80"], "models"),
    (["plan", "--model", "small", "--gpus", "8", "--gpu-memory", "80", "--profile", "gpu-small"],
     "profiles"),
    (["grid", "gpt-9b", "--dry-run"], "grid"),
    (["paper", "gpt-9b", "-o", "unused.md"], "grid"),
])
def test_an_unknown_name_lists_the_bundled_ones(argv, kind, elsewhere, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not exist: neither a file nor a bundled name" in err
    assert f"bundled {kind}: {', '.join(config_names(kind))}" in err
    assert not (elsewhere / "unused.md").exists()


REQUIRED = "required: num_layers, hidden_size, num_attention_heads"


@pytest.mark.parametrize("text, said", [
    ("num_layers: 4\nhidden_size: 64\n", f"missing required keys ['num_attention_heads'] "
                                           f"({REQUIRED})"),
    ("description: only words\n", "missing required keys ['num_layers', 'hidden_size', "
                                   "'num_attention_heads']"),
    ("", f"must be a mapping of ModelConfig fields, got an empty file; {REQUIRED}"),
    ("- 4\n- 64\n", "must be a mapping of ModelConfig fields, got list"),
    ("num_layers: 4\nhidden_size: [64\n", "is not YAML (while parsing a flow sequence"),
    ("num_layers: '4'\nhidden_size: 64\nnum_attention_heads: 4\n",
     "num_layers must be a whole number, got '4'"),
    ("num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: wide\n",
     "ffn_hidden_size must be a whole number or null, got 'wide'"),
    ("num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nswiglu: 1\n",
     "swiglu must be true or false, got 1"),
])
def test_a_bad_model_file_is_one_line_naming_the_file_and_the_keys(text, said, elsewhere,
                                                                   capsys):
    """Was a TypeError traceback (ModelConfig(**data) without a required key)."""
    (elsewhere / "mine.yaml").write_text(text)
    assert main(["plan", "--model", "mine.yaml", "--gpus", "8", "--gpu-memory", "80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vshape: error: --model: model config 'mine.yaml'") and said in err, err
    assert len(err.splitlines()) == 1


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="valid choices: models, grid, profiles"):
        find_config("model", "tiny")


@pytest.mark.parametrize("name, layers, hidden, ffn, heads, groups, vocab, billions", [
    ("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8.03),
    ("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, 70.55),
    ("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, 7.61),
    ("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, 72.7),
    ("gemma-2-9b", 42, 3584, 14336, 16, 8, 256000, 9.24),
])
def test_modern_models_have_their_published_shapes(name, layers, hidden, ffn, heads, groups,
                                                   vocab, billions):
    """The shapes of their config.json files (cited in each YAML); the parameter count within
    1% of the published size but for the learned positions the planner adds (seq x hidden)."""
    model = load_model_config(name)
    assert (model.num_layers, model.hidden_size, model.ffn, model.num_attention_heads,
            model.query_groups, model.vocab_size) == (layers, hidden, ffn, heads, groups, vocab)
    assert model.swiglu
    assert model.untie_embeddings_and_output_weights == (name != "gemma-2-9b")  # Gemma ties
    positions = model.seq_length * model.hidden_size
    assert (model.parameters() - positions) / 1e9 == pytest.approx(billions, rel=0.01)


def test_a_head_width_apart_from_hidden_over_heads():
    """kv_channels (Gemma-2: 16 heads of 256 over hidden 3584) widens the queries and the
    projection's input; set to hidden / heads it changes nothing."""
    from megatron_vshape.plan.cost import layer_flops
    from megatron_vshape.plan.memory import activation_sizes
    from megatron_vshape.plan.settings import TrainingConfig

    llama = load_model_config("llama-3-8b")
    same = llama.with_overrides(kv_channels=128)
    training = TrainingConfig(seq_length=4096, global_batch=8)
    assert same.layer_parameters() == llama.layer_parameters()
    assert layer_flops(same, 4096, 1) == layer_flops(llama, 4096, 1)
    assert activation_sizes(same, training, 2, 1) == activation_sizes(llama, training, 2, 1)
    gemma = load_model_config("gemma-2-9b")
    h, q, kv = 3584, 16 * 256, 2 * 8 * 256
    assert gemma.query_width == q
    attention = h * (q + kv) + (q + kv) + q * h + h  # QKV, its bias, projection, its bias
    mlp = 3 * h * 14336 + 2 * 14336 + h
    assert gemma.layer_parameters() == attention + mlp + 4 * h
    with pytest.raises(ValueError, match="kv_channels must be >= 1"):
        gemma.with_overrides(kv_channels=0)
