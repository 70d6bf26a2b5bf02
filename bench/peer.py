"""The PyTorch peer tooltrie is measured against: the best plain-PyTorch way to do the same job.

Benchmark-only (torch and xgrammar are not product dependencies). The recipe is gpt-fast's: the model
written directly in PyTorch with a static KV cache, the decode step compiled with
`torch.compile(mode="reduce-overhead")` (CUDA graphs), the prefill compiled with dynamic shapes, and
the catalog prefix's KV computed once and copied into each row. XGrammar computes the token mask on
the host for the grammar "k names of the catalog joined by the separator, then the stop token"; the
masked logits are argmaxed on the device and the chosen token crosses to the host every step (the
matcher must accept it before the next mask exists).

The weights are the very arrays tooltrie's backend loads (decoder_service.model.weights.Weights), so
both sides compute the same model; the prompts are the same token ids.

What a grammar cannot forbid, the peer does: name the same tool twice. `repeats` counts those answers.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
import xgrammar as xgr

from decoder_service.model.config import ModelConfig
from decoder_service.model.weights import Weights


def _bf16(a: np.ndarray, dtype: str, device) -> torch.Tensor:
    """A Weights array (bf16 stored as uint16, or a float dtype) as a torch bfloat16 tensor."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device, torch.bfloat16)


class PeerModel(torch.nn.Module):
    """Llama / Qwen3 decoder with a static KV cache of `rows` rows of `max_len` positions."""

    def __init__(self, cfg: ModelConfig, weights: Weights, rows: int, max_len: int, device="cuda"):
        super().__init__()
        self.cfg, self.rows, self.max_len = cfg, rows, max_len

        def w(a):
            return _bf16(a, weights.dtype, device)

        # Buffers, not plain attributes: torch.compile treats buffers as static inputs, so the CUDA
        # graphs read them in place (and may mutate the caches) instead of copying them in per replay.
        tensors = {"embed": weights.embed, "wqkv": weights.wqkv, "wo": weights.wo, "w_gate_up": weights.w_gate_up,
                   "w_down": weights.w_down, "attn_norm": weights.attn_norm, "mlp_norm": weights.mlp_norm,
                   "final_norm": weights.final_norm}
        if weights.lm_head is not weights.embed:
            tensors["lm_head"] = weights.lm_head
        if cfg.qkv_bias:
            tensors["bqkv"] = weights.bqkv
        if cfg.qk_norm:
            tensors.update(q_norm=weights.q_norm, k_norm=weights.k_norm)
        for name, a in tensors.items():
            self.register_buffer(name, w(a), persistent=False)
        self.tied = "lm_head" not in tensors
        d = cfg.head_dim
        inv_freq = (cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        shape = (cfg.num_layers, rows, cfg.num_kv_heads, max_len, d)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device), persistent=False)
        self.register_buffer("key_pos", torch.arange(max_len, device=device), persistent=False)

    def _norm(self, x, weight):
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.cfg.rms_norm_eps).to(torch.bfloat16)

    def _rope(self, x, pos):
        """HF rotate_half on x [B, heads, T, d] at positions pos [B, T]."""
        angle = pos[:, None, :, None].float() * self.inv_freq                    # [B, 1, T, d/2]
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the last position of each of the given cache rows.

        tokens, pos [B, T]; rows [B]: the cache rows these sequences live in (B == self.rows for the
        decode step, one row for a prefill)."""
        cfg = self.cfg
        B, T = tokens.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        all_rows = B == self.rows  # the decode step; a prefill attends over its own row's cache only
        mask = (self.key_pos[None, None, None, :] <= pos[:, None, :, None])         # [B, 1, T, max_len]
        x = self.embed[tokens]
        for layer in range(cfg.num_layers):
            h = self._norm(x, self.attn_norm[layer])
            qkv = h @ self.wqkv[layer].T
            if cfg.qkv_bias:
                qkv = qkv + self.bqkv[layer]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(B, T, nh, d).transpose(1, 2)
            k = k.view(B, T, nkv, d).transpose(1, 2)
            v = v.view(B, T, nkv, d).transpose(1, 2)
            if cfg.qk_norm:
                q, k = self._norm(q, self.q_norm[layer]), self._norm(k, self.k_norm[layer])
            q, k = self._rope(q, pos), self._rope(k, pos)
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            kc[rows[:, None], :, pos] = k.transpose(1, 2)
            vc[rows[:, None], :, pos] = v.transpose(1, 2)
            keys, values = (kc, vc) if all_rows else (kc[rows], vc[rows])
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, cfg.q_size) @ self.wo[layer].T
            h = self._norm(x, self.mlp_norm[layer])
            gate, up = (h @ self.w_gate_up[layer].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w_down[layer].T
        head = self.embed if self.tied else self.lm_head
        return (self._norm(x[:, -1], self.final_norm) @ head.T).float()


class PeerGrammar:
    """XGrammar for "k catalog names joined by the separator, then the stop token", per k."""

    def __init__(self, tokenizer, names: list[str], separator: str, stop_id: int, vocab_size: int):
        vocab = tokenizer.get_vocab()
        encoded = [""] * len(vocab)
        for piece, i in vocab.items():
            encoded[i] = piece
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                 stop_token_ids=[stop_id])
        self.compiler = xgr.GrammarCompiler(info)
        self.names, self.sep, self.vocab_size = names, separator, vocab_size
        self._compiled: dict[int, xgr.CompiledGrammar] = {}

    def ebnf(self, k: int) -> str:
        def quote(s):
            return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

        body = (" " + quote(self.sep) + " ").join(["name"] * k)
        return f"root ::= {body}\nname ::= " + " | ".join(quote(n) for n in self.names) + "\n"

    def matcher(self, k: int) -> xgr.GrammarMatcher:
        if k not in self._compiled:
            self._compiled[k] = self.compiler.compile_grammar(self.ebnf(k))
        return xgr.GrammarMatcher(self._compiled[k])


class Peer:
    """The peer's serving loop over `rows` cache rows of `max_len` positions (one compiled model)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, rows: int, max_len: int, compile: bool = True):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = PeerModel(cfg, weights, rows, max_len, self.device)
        self.rows, self.max_len = rows, max_len
        self.bitmask = xgr.allocate_token_bitmask(rows, cfg.vocab_size)
        self.bitmask_dev = self.bitmask.to(self.device)
        on_gpu = compile and self.device == "cuda"
        self.decode = torch.compile(self.model, mode="reduce-overhead", fullgraph=True) if on_gpu else self.model
        self.prefill = torch.compile(self.model, dynamic=True) if on_gpu else self.model

    def load_catalog(self, tokenizer, names, separator: str, stop_id: int, prefix_ids: list[int]) -> float:
        """Compile the catalog's grammar and compute its prefix KV once (in row 0); returns seconds."""
        started = time.perf_counter()
        self.grammar = PeerGrammar(tokenizer, names, separator, stop_id, self.model.cfg.vocab_size)
        self.tok, self.stop_id, self.prefix_len = tokenizer, stop_id, len(prefix_ids)
        with torch.inference_mode():
            self.model(*self._tensors([prefix_ids], 0, [0]))
            self.prefix_k = self.model.k_cache[:, 0, :, :self.prefix_len].clone()
            self.prefix_v = self.model.v_cache[:, 0, :, :self.prefix_len].clone()
        self._sync()
        return time.perf_counter() - started

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _tensors(self, token_rows, start, rows):
        T = len(token_rows[0])
        tokens = torch.tensor(token_rows, dtype=torch.long, device=self.device)
        start = torch.as_tensor(start, device=self.device).reshape(-1, 1)
        pos = start + torch.arange(T, device=self.device)[None, :]
        return tokens, pos, torch.tensor(rows, dtype=torch.long, device=self.device)

    def run(self, requests: list[tuple[list[int], int]], on_pointer=None) -> list[dict]:
        """Answer up to `rows` requests (suffix token ids, k) in lockstep; one dict per request.

        on_pointer(i) is called when request i's first name is complete (time to first pointer)."""
        n = len(requests)
        assert 0 < n <= self.rows
        m = self.model
        with torch.inference_mode():
            matchers, logits, pos = [], [], []
            for i, (suffix, k) in enumerate(requests):  # the cached prefix, then this row's suffix
                m.k_cache[:, i, :, :self.prefix_len] = self.prefix_k
                m.v_cache[:, i, :, :self.prefix_len] = self.prefix_v
                logits.append(self.prefill(*self._tensors([suffix], self.prefix_len, [i])))
                pos.append(self.prefix_len + len(suffix))
                matchers.append(self.grammar.matcher(k))
            logits = torch.cat(logits + [logits[0]] * (self.rows - n))
            pos = pos + [pos[0]] * (self.rows - n)
            out = [[] for _ in range(n)]
            first = [False] * n
            steps = 0
            while True:
                live = [i for i in range(n) if not matchers[i].is_terminated()]
                if not live:
                    break
                for i in live:
                    matchers[i].fill_next_token_bitmask(self.bitmask, i)
                self.bitmask_dev.copy_(self.bitmask, non_blocking=True)
                xgr.apply_token_bitmask_inplace(logits, self.bitmask_dev, vocab_size=self.model.cfg.vocab_size)
                chosen = logits.argmax(dim=-1).tolist()
                for i in live:
                    t = chosen[i]
                    if not matchers[i].accept_token(t):
                        raise RuntimeError(f"xgrammar refused its own masked token {t}")
                    out[i].append(t)
                    if not first[i] and on_pointer and (t == self.stop_id or self.grammar.sep in self.tok.decode([t])):
                        first[i] = True
                        on_pointer(i)
                if all(matchers[i].is_terminated() for i in range(n)):
                    break
                tokens = torch.tensor([[chosen[i] if i < n else self.stop_id] for i in range(self.rows)],
                                      device=self.device)
                positions = torch.tensor([[p] for p in pos], device=self.device)
                if max(pos) + 1 >= self.max_len:
                    raise RuntimeError("peer ran out of cache positions")
                logits = self.decode(tokens, positions, torch.arange(self.rows, device=self.device)).clone()
                pos = [p + 1 for p in pos]
                steps += 1
        answers = []
        for i in range(len(requests)):
            text = self.tok.decode([t for t in out[i] if t != self.stop_id], skip_special_tokens=False)
            names = text.split(self.grammar.sep)
            answers.append({"names": names, "tokens": len(out[i]), "repeat": len(set(names)) != len(names)})
        return answers


def bytes_per_token(cfg: ModelConfig, max_len: int) -> int:
    """KV bytes one peer row reads per decode step (it attends over the whole static cache)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * max_len * cfg.head_dim * 2


def round_len(n: int, multiple: int = 256) -> int:
    return int(math.ceil(n / multiple) * multiple)
