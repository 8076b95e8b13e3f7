#!/usr/bin/env python3
"""llama.cpp's convert_hf_to_gguf.py on a checkpoint from bench/make_checkpoint.py, which has no tokenizer
files: the GGUF gets 163840 placeholder tokens (llama-bench feeds token ids, never text) and one merge
(llama.cpp's loader needs the key). Everything else is llama.cpp's own conversion. Usage:

    convert_to_gguf.py LLAMA_CPP_SOURCE_DIR CHECKPOINT_DIR --outtype bf16 --outfile OUT.gguf

Debian's PyTorch 1.13 lacks dtypes the converter names in a table; they are stubbed (the checkpoint holds
none of them). Needs torch, numpy and transformers (for AutoConfig) in the Python that runs it.
"""
import sys

SRC = sys.argv.pop(1)
sys.path[:0] = [SRC, SRC + "/gguf-py"]

import torch  # noqa: E402

for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if not hasattr(torch, _name):
        setattr(torch, _name, type(_name, (), {})())

import convert_hf_to_gguf  # noqa: E402
import gguf  # noqa: E402
from conversion.kimi_linear import KimiLinearModel  # noqa: E402
from conversion.qwen import QwenModel  # noqa: E402


def set_vocab(self):
    n = self.hparams["vocab_size"]
    toks = [QwenModel.token_bytes_to_string(bytes([b])) for b in range(256)]
    toks += [toks[0] + toks[1]] + [f"[T{i}]" for i in range(257, n)]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list(toks)
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([toks[0] + " " + toks[1]])
    self.gguf_writer.add_bos_token_id(self.hparams["bos_token_id"])
    self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])


KimiLinearModel.set_vocab = set_vocab
convert_hf_to_gguf.main()
