"""Lightning data modules (thin adapters over files of role examples)."""

from datamodules.prefix_packing import pack_prefix_chains
from datamodules.role_examples import (
    IGNORE_INDEX,
    LengthBucketBatchSampler,
    RoleExampleDataModule,
    RoleExampleDataset,
    RoleRecord,
    TokenizedExample,
    collate_examples,
    last_piece_start,
    read_records,
    resolve_tokenizer,
    split_indices,
    tokenize_example,
)
from datamodules.tiny_tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "LengthBucketBatchSampler",
    "RoleExampleDataModule",
    "RoleExampleDataset",
    "RoleRecord",
    "TokenizedExample",
    "byte_tokenizer",
    "collate_examples",
    "last_piece_start",
    "pack_prefix_chains",
    "read_records",
    "resolve_tokenizer",
    "split_indices",
    "tokenize_example",
]
