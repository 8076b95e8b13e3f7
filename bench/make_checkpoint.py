#!/usr/bin/env python3
"""A Kimi-Linear checkpoint folder with random weights at the real widths (kda/io/kimi_linear_48b.h), for
load and speed measurements: the first --layers decoder layers of the 48B pattern (KDA, with an MLA layer
every fourth), --experts routed experts per MoE layer, bf16 (A_log and dt_bias fp32, as the real
checkpoint stores them). One shard per decoder layer, then the embedding, norm and head; the index and
config.json as the real checkpoint has them. Needs numpy only.

    bench/make_checkpoint.py --out /tmp/kimi4 --layers 4 --experts 32
"""
import argparse
import json
import os
import struct

import numpy as np

D, H, K, W = 2304, 32, 128, 4
P = H * K
HM, R, DN, DR, DV = 32, 512, 128, 64, 128
I_DENSE, I_MOE, VOCAB = 9216, 1024, 163840
KDA_LAYERS = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]


def bf16_bytes(a):
    """float32 array -> bf16 bytes (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.tobytes()


def write_shard(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    return off


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    L, E = a.layers, a.experts
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=False)

    def mat(rows, cols, gain=1.0):
        return ("BF16", (rows, cols),
                bf16_bytes(rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))))

    def vec(n, mean=1.0, sd=0.1):
        return ("BF16", (n,), bf16_bytes(mean + sd * rng.standard_normal(n, dtype=np.float32)))

    def f32(shape, values):
        return ("F32", shape, np.asarray(values, dtype=np.float32).tobytes())

    kda = [i for i in KDA_LAYERS if i <= L]
    mla = [i for i in range(1, L + 1) if i not in kda]
    n_shards, weight_map, total = L + 1, {}, 0
    for i in range(L):
        t, p = [], f"model.layers.{i}."
        s = p + "self_attn."
        t.append((p + "input_layernorm.weight",) + vec(D))
        t.append((p + "post_attention_layernorm.weight",) + vec(D))
        if i + 1 in kda:
            for n in ("q", "k", "v"):
                t.append((s + f"{n}_proj.weight",) + mat(P, D))
                t.append((s + f"{n}_conv1d.weight", "BF16", (P, 1, W),
                          bf16_bytes(0.5 * rng.standard_normal((P, 1, W), dtype=np.float32))))
            t.append((s + "A_log",) + f32((1, 1, H, 1), np.log(rng.uniform(1, 16, H))))
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), P))
            t.append((s + "dt_bias",) + f32((P,), dt + np.log(-np.expm1(-dt))))
            t.append((s + "f_a_proj.weight",) + mat(K, D))
            t.append((s + "g_a_proj.weight",) + mat(K, D))
            t.append((s + "f_b_proj.weight",) + mat(P, K, 0.23))
            t.append((s + "g_b_proj.weight",) + mat(P, K, 0.23))
            t.append((s + "b_proj.weight",) + mat(H, D))
            t.append((s + "o_norm.weight",) + vec(K))
            t.append((s + "o_proj.weight",) + mat(D, P))
        else:
            t.append((s + "q_proj.weight",) + mat(HM * (DN + DR), D))
            t.append((s + "kv_a_proj_with_mqa.weight",) + mat(R + DR, D, 0.45))
            t.append((s + "kv_a_layernorm.weight",) + vec(R))
            t.append((s + "kv_b_proj.weight",) + mat(HM * (DN + DV), R))
            t.append((s + "o_proj.weight",) + mat(D, HM * DV))
        if i >= 1:
            m = p + "block_sparse_moe."
            t.append((m + "gate.weight",) + mat(E, D))
            t.append((m + "gate.e_score_correction_bias",) + f32((E,), 0.1 * rng.standard_normal(E)))
            for e in range(E):
                x = m + f"experts.{e}."
                t.append((x + "w1.weight",) + mat(I_MOE, D))
                t.append((x + "w2.weight",) + mat(D, I_MOE, 0.5))
                t.append((x + "w3.weight",) + mat(I_MOE, D))
            t.append((m + "shared_experts.gate_proj.weight",) + mat(I_MOE, D))
            t.append((m + "shared_experts.up_proj.weight",) + mat(I_MOE, D))
            t.append((m + "shared_experts.down_proj.weight",) + mat(D, I_MOE, 0.5))
        else:
            t.append((p + "mlp.gate_proj.weight",) + mat(I_DENSE, D))
            t.append((p + "mlp.up_proj.weight",) + mat(I_DENSE, D))
            t.append((p + "mlp.down_proj.weight",) + mat(D, I_DENSE, 0.5))
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        total += write_shard(os.path.join(a.out, name), t)
        weight_map.update({x[0]: name for x in t})
    t = [("model.embed_tokens.weight", "BF16", (VOCAB, D),
          bf16_bytes(rng.standard_normal((VOCAB, D), dtype=np.float32))),
         ("model.norm.weight",) + vec(D), ("lm_head.weight",) + mat(VOCAB, D)]
    name = f"model-{n_shards:05d}-of-{n_shards:05d}.safetensors"
    total += write_shard(os.path.join(a.out, name), t)
    weight_map.update({x[0]: name for x in t})
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": D,
        "num_hidden_layers": L, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "linear_attn_config": {"num_heads": H, "head_dim": K, "short_conv_kernel_size": W,
                               "kda_layers": kda, "full_attn_layers": mla},
        "q_lora_rank": None, "mla_use_nope": True, "num_attention_heads": HM, "num_key_value_heads": HM,
        "kv_lora_rank": R, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "v_head_dim": DV,
        "hidden_act": "silu", "intermediate_size": I_DENSE, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": E, "num_experts_per_token": min(8, E), "num_shared_experts": 1,
        "moe_intermediate_size": I_MOE, "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{a.out}: {L} layers, {E} experts, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
