"""The public API contract: names, the README example, and lazy imports."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tevjax


def test_contract_names_and_fields():
    tree = tevjax.DraftTree.from_parents(jnp.array([5, 1, 2, 3]), jnp.array([-1, 0, 0, 1]))
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.3, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2],
                                [0.5, 0.5, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]))
    law = tevjax.exit_law(tree, logits, temperature=1.0)
    np.testing.assert_allclose(law.prefix_prob, [1.0, 0.5, 0.3, 0.5 * 0.2], rtol=1e-6)
    np.testing.assert_allclose(law.local_exit, [0.2, 0.8, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(law.exit_prob, [0.2, 0.4, 0.3, 0.1], rtol=1e-6)
    np.testing.assert_allclose(law.coverage, 0.5 + 0.3 + 0.1, rtol=1e-6)
    for method in ("tev", "predraw", "sequential"):
        out = tevjax.verify(jax.random.key(0), tree, logits, temperature=1.0, method=method)
        for field in ("exit_node", "bonus_token", "num_accepted", "path", "tokens", "num_tokens"):
            assert getattr(out, field).dtype == jnp.int32
        assert out.exit_node.shape == () and out.path.shape == (3,) and out.tokens.shape == (4,)
    greedy = tevjax.verify(jax.random.key(0), tree, logits, temperature=0.0)
    assert int(greedy.exit_node) == 1 and int(greedy.bonus_token) == 0  # node 1 row is uniform: argmax 0


def test_import_is_light():
    code = "import sys, tevjax; print('flax' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_lazy_names_resolve():
    for name in tevjax.__all__:
        assert getattr(tevjax, name) is not None
    assert tevjax.Decoder.__module__ == "tevjax.decode.engine"


def _readme_python_blocks() -> list[str]:
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, flags=re.S)


def test_readme_core_example_runs():
    block = _readme_python_blocks()[0]
    scope: dict = {}
    exec(compile(block.replace("100_000", "1_000"), "README.md", "exec"), scope)
    assert scope["outs"].num_tokens.shape == (1_000,)
    assert abs(float(scope["law"].exit_prob.sum()) - 1.0) < 1e-5


@pytest.mark.slow
def test_readme_model_examples_run(capsys):
    """The README's decoding examples (load, generate, a next turn, stop strings, continuous
    batching) run as written on the embedded target, with fewer tokens; greedy, so every output
    equals autoregressive decoding's."""
    decoding, continuous = _readme_python_blocks()[1:3]
    def short(code: str) -> str:
        return code.replace("max_new_tokens=128", "max_new_tokens=16").replace("[32, 128]", "[8, 16]")

    turns, stops = short(decoding).split("# Stop strings")
    scope: dict = {}
    exec(compile("import dataclasses, tevjax\n" + turns, "README.md", "exec"), scope)
    models, prompt, follow = scope["models"], scope["prompt"], scope["follow"]
    ar = tevjax.Decoder(models.target, None, tevjax.DecodeConfig(max_new_tokens=16, eos_ids=models.eos_ids))
    assert scope["gen"].tokens == ar.generate([prompt])[0].tokens
    assert scope["reply"] == scope["gen"].tokens  # run(prefill) is generate, one step at a time
    assert scope["decoder"].results(scope["state"])[0].tokens == ar.generate([follow])[0].tokens  # the next turn
    exec(compile("# Stop strings" + stops, "README.md", "exec"), scope)
    assert [g.stop for g in scope["gens"]] == ["eos", "eos"] and scope["text"]
    exec(compile(short(continuous), "README.md", "exec"), scope)
    assert len(capsys.readouterr().out.strip().splitlines()) >= 3  # one line per prompt (more if they hold newlines)
