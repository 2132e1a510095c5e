"""The deployment: which model, which vLLM engine arguments, which plugins with which parameters.

A deployment file looks like::

    model: models/graft-tiny-llama      # optional: else the model vLLM is started with
    platform: auto                      # auto | cpu | cuda
    engine:                             # vLLM engine arguments, passed through
      dtype: float32
      max_model_len: 2048
    kvcompress:                         # one plugin, or a list of one per role (KindSpec.roles):
      - plugin: streaming               #   an eviction compressor...
        params: {sink_blocks: 1, budget_blocks: 4}
      - plugin: kv4                     #   ...and a KV storage format
    moe:                                # several plugins compose freely
      - plugin: expert-mask
        params: {mask_file: masks.json}
    speculative:                        # one proposer; max_batch (optional): a load limit,
      plugin: lookahead                 #   no drafts in steps of more decoding requests
      max_batch: 8

Validation happens before any engine starts and reports every problem at once; each
problem names the field path, the value found, and what would be accepted.
"""

from __future__ import annotations

from .load import ModelInfo, load_file, model_features, parse_json
from .problems import DeploymentError, Problem, did_you_mean, pydantic_problems
from .schema import DTYPE_ALIASES, Deployment, PluginChoice
from .validate import (
    DEFAULT_BLOCK_SIZES,
    DeploymentContext,
    Enabled,
    Environment,
    Plan,
    param_path,
    validate,
    validate_file,
)

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "DTYPE_ALIASES",
    "Deployment",
    "DeploymentContext",
    "DeploymentError",
    "Enabled",
    "Environment",
    "ModelInfo",
    "Plan",
    "PluginChoice",
    "Problem",
    "did_you_mean",
    "load_file",
    "model_features",
    "param_path",
    "parse_json",
    "pydantic_problems",
    "validate",
    "validate_file",
]
