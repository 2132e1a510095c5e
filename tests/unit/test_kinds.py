"""The KindSpec table (hooks/kinds.py) is the one source of each kind's facts: every place that
differs by kind covers exactly its kinds, and reads from it."""
import importlib.util

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_graft.hooks import (
    CONTRACTS, KINDS, Capabilities, KVCacheFormat, KVCompressor, Kind, Params, Registration,
    contract_for, specs,
)
from vllm_graft.hooks.deployment import Deployment
from vllm_graft.hooks.kinds import ENGINE_KEYS_OWNED, HOOK_KINDS
from vllm_graft.hooks.registry import SUPPORTED_VLLM
from vllm_graft.integration.adapters import adapter_module


def test_every_kind_has_one_spec_and_each_spec_names_real_things():
    assert list(KINDS) == list(Kind)
    for kind, spec in KINDS.items():
        assert spec.kind is kind and spec.section == kind.value
        assert callable(getattr(specs, spec.hook)), spec.hook  # its hookspec exists
        assert CONTRACTS[kind].__name__ == spec.contract
        assert importlib.util.find_spec(adapter_module(kind)) is not None, adapter_module(kind)
        assert spec.route("cpu") and spec.route("cuda") and spec.route(None)
        for role in spec.roles:
            assert contract_for(kind, role.name).__name__ == role.contract


def test_hook_and_engine_key_tables_are_derived_from_the_specs():
    assert HOOK_KINDS == {s.hook: k for k, s in KINDS.items()}
    assert set(ENGINE_KEYS_OWNED) == {"speculative_config", "quantization"}  # attention_backend: the user's choice (CUDA overrides all three stock backends)


def test_deployment_has_one_section_per_kind_shaped_by_allows_many():
    fields = Deployment.model_fields
    for kind, spec in KINDS.items():
        assert spec.section in fields, spec.section
        many = "list" in str(fields[spec.section].annotation)
        assert many == spec.allows_many, spec.section


def test_scaffold_and_conformance_cover_every_kind():
    from vllm_graft.kit import scaffold

    assert set(scaffold.TEMPLATES) == set(Kind)


def test_roles_have_their_own_contract():
    assert contract_for("kvcompress") is KVCompressor
    assert contract_for("kvcompress", "eviction") is KVCompressor
    assert contract_for("kvcompress", "storage") is KVCacheFormat
    assert not issubclass(KVCacheFormat, KVCompressor)  # a storage format evicts nothing


def test_check_deployment_belongs_to_params():
    class Checked(Params):
        n: int = 1

        def check_deployment(self, ctx):
            return ["too many"] if self.n > 1 else []

    reg = Registration(name="x", summary="s", paper="-", params=Checked, impl="m:C",
                       capabilities=Capabilities(lossless=True))
    assert reg.params(n=2).check_deployment(None) == ["too many"]

    class Stray(BaseModel):  # a check validation would never call: refused with the fix
        model_config = ConfigDict(extra="forbid")

        def check_deployment(self, ctx):
            return ["never seen"]

    with pytest.raises(ValidationError, match="subclass of vllm_graft.hooks.Params"):
        Registration(name="x", summary="s", paper="-", params=Stray, impl="m:C",
                     capabilities=Capabilities(lossless=True))


def test_supported_vllm_is_declared_once():
    from vllm_graft.integration import bridge

    assert Capabilities(lossless=True).vllm_versions == SUPPORTED_VLLM
    assert bridge.SUPPORTED_VLLM is SUPPORTED_VLLM
