"""Every ``python`` block of the README runs as written, in order, in one namespace: the README
cannot drift from the code. A block that needs an optional framework this machine lacks is
skipped (and said); ``path/to/model`` is a model folder the test writes."""

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
OPTIONAL = {"torch", "jax", "dask", "cupy", "distributed", "transformers"}


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert len(_blocks()) >= 5


def test_every_python_block_runs(tmp_path, monkeypatch):
    model = tmp_path / "path" / "to" / "model"
    model.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    (model / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    skipped = []
    for number, block in enumerate(_blocks()):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except ModuleNotFoundError as error:
            if error.name not in OPTIONAL:
                raise
            skipped.append(f"block {number} needs {error.name}")
    if skipped:
        pytest.skip("; ".join(skipped) + " (the others ran)")


def test_docstring_examples():
    import doctest

    import arrayrope
    from arrayrope import _api, rope

    for module in (arrayrope, _api, rope):
        failed, _ = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert failed == 0, module.__name__
