"""integration/plan.py: plan_for, the one way from a deployment (file, dict, additional_config)
to a validated plan, and the hand-over that validates an in-process engine's plan once."""
import json

import pytest

from vllm_graft.hooks import DeploymentError
from vllm_graft.integration import plan as plans
from vllm_graft.integration.plan import deployment_for_engine, plan_for

from vllm_graft.launch import engine as launch

REPO = launch.repo_root()
NOOP = REPO / "deployments" / "noop.yaml"


def test_every_form_of_a_deployment_gives_the_same_plan():
    from_file = plan_for(NOOP)
    text = from_file.deployment.to_json()
    data = json.loads(text)
    forms = [str(NOOP), {"__file__": str(NOOP)}, data, {"graft": data, "other": 1}, {"graft": text},
             json.dumps({"graft": data})]
    for form in forms:
        assert plan_for(form).deployment.to_json() == text, form
    assert from_file.deployment.model.startswith("/")  # relative to the file, made absolute


def test_the_source_named_in_errors():
    with pytest.raises(DeploymentError) as e:
        plan_for({"attention": {"plugin": "nope"}}, source="mine")
    assert e.value.source == "mine"
    with pytest.raises(DeploymentError) as e:
        plan_for({"graft": {"attention": {"plugin": "nope"}}})
    assert e.value.source == "additional_config.graft"
    with pytest.raises(DeploymentError, match="must be a mapping"):
        plan_for(["attention"])
    with pytest.raises(DeploymentError, match="is empty"):
        plan_for({"graft": None})


def _counting(monkeypatch):
    calls = []
    real = plans.validate

    def validate(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(plans, "validate", validate)
    return calls


def test_an_in_process_engine_gets_the_validated_plan_back(monkeypatch):
    """What `generate` does: validate the file, start vLLM with the plan's additional_config;
    the bridge's create_engine_config hook then asks for it with the engine's model and flags."""
    calls = _counting(monkeypatch)
    plan = plan_for(NOOP)
    kwargs = launch.llm_kwargs(plan)
    engine = plan.deployment.engine
    flags = {"dtype": engine["dtype"]} if "dtype" in engine else {}
    again = plan_for(plans.graft_section(kwargs["additional_config"]), source="additional_config.graft",
                     engine_model=kwargs["model"], engine_args=flags)
    assert again is plan and len(calls) == 1  # validated once


def test_anything_else_is_validated_again(monkeypatch):
    calls = _counting(monkeypatch)
    plan = plan_for(NOOP)
    cfg = deployment_for_engine(plan)
    plan_for(cfg["graft"])  # not an engine starting (another process does this: it must validate)
    assert len(calls) == 2
    plan = plan_for(NOOP)
    other = plan_for(deployment_for_engine(plan)["graft"], engine_model=plan.deployment.model,
                     engine_args={"max_num_seqs": 3})  # the engine was started with more: a new deployment
    assert other is not plan and other.deployment.engine["max_num_seqs"] == 3 and len(calls) == 4
    plan = plan_for(NOOP)
    given = deployment_for_engine(plan)["graft"]
    plan.deployment.engine["max_model_len"] = 64  # changed since it was validated: not that deployment
    again = plan_for(given, engine_model=plan.deployment.model)
    assert again is not plan and again.deployment.engine["max_model_len"] == 2048


def test_plan_adapters_are_those_of_the_enabled_kinds():
    plan = plan_for({"model": str(REPO / "models" / "graft-tiny-llama"), "attention": {"plugin": "noop"},
                     "quant": {"plugin": "noop"}})
    assert [str(a.kind) for a in plans.plan_adapters(plan)] == ["attention", "quant"]
