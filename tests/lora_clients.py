"""FlowerTune-style LoRA clients for tests/test_flower_bridge.py, run in Flower's environment.

The model is a 2-layer Llama built from a transformers config with random weights (nothing is
downloaded), wrapped by PEFT in a rank-8 LoRA adapter on its attention's q and v projections.
Every client trains the adapter on token sequences of one shared toy language (each token
determines the next) started from tokens of its own range, so clients differ and the federated
adapter learns what none sees alone. A reply carries the adapter alone, in bfloat16 (Arrays of
ml_dtypes' bfloat16, as a FlowerTune client casting its adapter would send)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
SEQUENCE = 12
SEQUENCES_PER_CLIENT = 16
LOCAL_STEPS = 4
LEARNING_RATE = 0.05

torch.set_num_threads(1)


def lora_model(seed: int = 0) -> Any:
    """The base model (random weights from ``seed``) with a fresh LoRA adapter (lora_B zero)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQUENCE)
    adapter = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(LlamaForCausalLM(config), adapter)


def adapter_record(model: Any) -> ArrayRecord:
    """The model's adapter (nothing of the base) as bfloat16 Arrays."""
    state = get_peft_model_state_dict(model)
    return ArrayRecord({k: Array(v.detach().to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16))
                        for k, v in state.items()})


def load_adapter(model: Any, record: ArrayRecord) -> None:
    """Set the model's adapter from bfloat16 Arrays (their .npy payload is 2-byte voids)."""
    state = {k: torch.from_numpy(a.numpy().view(np.int16).copy()).view(torch.bfloat16).float() for k, a in record.items()}
    set_peft_model_state_dict(model, state)


def widened(record: ArrayRecord) -> ArrayRecord:
    """A bfloat16 record as float32 (exactly): what Flower's FedAvg can multiply."""
    return ArrayRecord({k: Array(a.numpy().view(ml_dtypes.bfloat16).astype(np.float32)) for k, a in record.items()})


def sequences(client: int, count: int) -> torch.Tensor:
    """``count`` sequences of the toy language (next = 5 * token + 3 mod VOCAB) from starts in the client's range."""
    rng = np.random.default_rng(client)
    low = (client * VOCAB // 4) % VOCAB
    starts = rng.integers(low, low + VOCAB // 4, count)
    rows = [starts]
    for _ in range(SEQUENCE - 1):
        rows.append((5 * rows[-1] + 3) % VOCAB)
    return torch.from_numpy(np.stack(rows, axis=1))


def loss(model: Any, tokens: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


def train(model: Any, record: ArrayRecord, client: int) -> RecordDict:
    """A client's reply: the adapter after LOCAL_STEPS of full-batch SGD from ``record`` on its data."""
    load_adapter(model, record)
    tokens = sequences(client, SEQUENCES_PER_CLIENT)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    for _ in range(LOCAL_STEPS):
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    return RecordDict({"arrays": adapter_record(model), "metrics": MetricRecord({"num-examples": len(tokens) + client})})
