"""A KV compressor's shape (hooks.contracts.kvcompress.shape_problems): which flags and methods go
together, and what the shape may be combined with, checked without vLLM at validation and by the
kit; one test per rule, each planted on a class the rule must refuse and one it must let through."""

import pytest

from vllm_graft.hooks import DeploymentError, KVCacheFormat, KVCompressor, get_registry, validate
from vllm_graft.hooks.contracts import SHAPE_CHECKS, Kind, shape_problems
from vllm_graft.kit.conformance.checks import CHECKS


class Keeps(KVCompressor):
    def keep(self, view):
        return list(range(view.num_blocks))


class Scored(Keeps):
    needs_scores = True


class PerHead(Scored):
    per_head = True

    def keep_heads(self, view):
        return [self.keep(view)]


class PerLayer(Scored):
    per_layer = True

    def keep_layers(self, view):
        return [self.keep(view)]


class Merging(Scored):
    merges = True

    def merge(self, *a):
        return a[2], a[3], None


class CacheScored(Scored):
    def block_scores(self, kv_cache, batch, layer):
        return None


def messages(impl, others=()):
    return [p.message for p in shape_problems(Kind.KVCOMPRESS, impl, others)]


@pytest.mark.parametrize("good", [Keeps, Scored, PerHead, PerLayer, Merging, CacheScored])
def test_a_well_shaped_class_passes(good):
    assert messages(good) == []


@pytest.mark.parametrize(
    "flags, methods, why",
    [
        ({"per_head": True, "needs_scores": False}, PerHead, "per_head = True), but it does not set needs_scores"),
        ({"keep_heads": KVCompressor.keep_heads}, PerHead, "implements no keep_heads()"),
        ({"block_scores": CacheScored.block_scores}, PerHead, "scores blocks from the cache"),
        ({"needs_scores": False}, PerLayer, "per_layer = True), but it does not set needs_scores"),
        ({"per_head": True, "keep_heads": PerHead.keep_heads}, PerLayer, "per_head is set too"),
        ({"keep_layers": KVCompressor.keep_layers}, PerLayer, "implements no keep_layers()"),
        ({"block_scores": CacheScored.block_scores}, PerLayer, "scores blocks from the cache"),
        ({"needs_scores": False}, Merging, "merges = True), but it does not set needs_scores"),
        ({"merge": KVCompressor.merge}, Merging, "implements no merge()"),
        ({"per_head": True, "keep_heads": PerHead.keep_heads}, Merging, "chooses blocks per KV head or per layer"),
    ],
)
def test_each_rule_refuses_its_planted_shape(flags, methods, why):
    bad = type("Bad", (methods,), dict(flags))
    found = messages(bad)
    assert any(why in m for m in found), found


class Format(KVCacheFormat):
    def bytes_per_token(self, head_size, block_size):
        return 1

    def write(self, *a):
        pass

    def forward(self, *a, **k):
        return None, None


def test_what_a_shape_may_be_combined_with():
    attention, fmt = ("attention", "hydragen", None), ("kvcompress", "kv4", Format)
    assert shape_problems(Kind.KVCOMPRESS, Keeps, [attention, fmt]) == []  # unscored: anything goes
    (p,) = shape_problems(Kind.KVCOMPRESS, Scored, [attention, fmt])
    assert p.other == "attention:hydragen" and "attention scores" in p.message
    for masked in (PerHead, PerLayer, Merging):
        assert {p.other for p in shape_problems(Kind.KVCOMPRESS, masked, [attention, fmt])} == {
            "attention:hydragen",
            "kvcompress:kv4",
        }
    (p,) = shape_problems(Kind.KVCOMPRESS, Format, [attention, ("kvcompress", "h2o", Scored)])
    assert p.other == "attention:hydragen" and "own layout" in p.message


def test_every_built_in_compressor_passes_and_declares_no_combination_by_hand():
    for entry in get_registry().entries():
        if entry.kind != Kind.KVCOMPRESS:
            continue
        assert messages(entry.registration.load()) == [], entry.name
        caps = entry.registration.capabilities
        assert not [c for c in caps.incompatible_with if c.startswith(("attention:", "kvcompress:"))], (
            f"{entry.name} writes by hand what its shape says"
        )


def test_validation_refuses_what_the_shape_refuses(registry, cpu_env, tmp_path):
    from pathlib import Path

    llama = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
    with pytest.raises(DeploymentError) as e:
        validate(
            {"model": llama, "attention": {"plugin": "hydragen"}, "kvcompress": {"plugin": "tova"}}, registry, cpu_env
        )
    (p,) = e.value.problems
    assert p.path == "kvcompress.plugin" and "'tova' cannot be combined with attention plugin 'hydragen'" in p.message
    assert "attention scores" in p.message and p.hint == "Enable only one of them"
    validate({"model": llama, "kvcompress": {"plugin": "tova"}}, registry, cpu_env)


def test_the_kit_runs_the_shape_check_for_the_kinds_that_have_one():
    (check,) = [c for c in CHECKS if c.name == "shape"]
    assert check.kinds == tuple(SHAPE_CHECKS) == (Kind.KVCOMPRESS,)
