"""A text encoder's token embedding kept in host memory, looked up on the host.

A streamed encoder's largest module outside its layers is often its token table: UMT5-XXL's
is 2.1 GB (256k tokens x 4096), Qwen2.5-VL's 1.09 GB - more than its two layer slots. An
encode reads a few hundred rows of it, so the table stays on the host and only the rows a
prompt batch looks up (a few MB) are uploaded. The lookup is a gather, so the rows are the
resident table's exactly.

Pipelines pass an encoder host token ids (``token_ids``) when its table is on the host: the
lookup then needs no device-to-host copy of the ids, which would wait for every step queued
before the encode.
"""

from __future__ import annotations

import torch
from torch import nn

from ditserve.engine.pipelines.common import upload


class HostEmbedding(nn.Module):
    """Wraps an ``nn.Embedding`` whose weight is in host memory; returns rows on ``device``."""

    def __init__(self, table: nn.Embedding, device: torch.device) -> None:
        super().__init__()
        self.table = table
        self.device = device

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    @property
    def num_embeddings(self) -> int:
        return self.table.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.table.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Ids on the device (a caller that did not use token_ids) cost one host sync.
        host_ids = ids if ids.device.type == "cpu" else ids.cpu()
        return upload(self.table(host_ids), self.device)


def embedding_module(encoder: nn.Module, which: str = "input") -> nn.Module | None:
    """A transformers model's ``input`` (token table) or ``output`` (head) embedding module,
    None where it has none."""
    get = getattr(encoder, f"get_{which}_embeddings", None)
    module = get() if callable(get) else None
    return module if isinstance(module, nn.Module) else None


def host_embedding(encoder: nn.Module) -> HostEmbedding | None:
    """``encoder``'s input embedding if it is kept on the host."""
    table = embedding_module(encoder)
    return table if isinstance(table, HostEmbedding) else None


def token_ids(encoder: nn.Module, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The token ids ``encoder`` reads: ``host`` itself when its table is on the host, else
    uploaded to ``device``."""
    return host if host_embedding(encoder) is not None else upload(host, device)
