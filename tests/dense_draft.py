"""The published EAGLE and EAGLE-3 draft architectures computed plainly from a checkpoint's tensors: the
reference the served drafts (test_eagle.py) and trained heads (test_train_eagle3.py) are checked against."""

from __future__ import annotations

import json

import torch


class DenseDraft:
    """The published draft architectures computed plainly from the checkpoint's tensors: causal
    attention over the whole sequence from position 0, no cache; features from transformers' target."""

    def __init__(self, target_dir, draft_dir, layout: str, aux: tuple[int, ...] = ()):
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.t = torch.load(draft_dir / "pytorch_model.bin")
        self.layout, self.aux = layout, aux

    def features(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hs = self.target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        if self.layout == "EAGLE":
            return hs[-1][0]                                   # final normed
        return torch.cat([hs[i][0] for i in self.aux], -1) @ self.t["fc.weight"].T

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def _attention(self, x, prefix, start):
        t, c = self.t, self.cfg
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        n, hd = x.shape[0], c["hidden_size"] // heads
        q = (x @ t[f"{prefix}.q_proj.weight"].T).view(n, heads, hd).transpose(0, 1)
        k = (x @ t[f"{prefix}.k_proj.weight"].T).view(n, kv_heads, hd).transpose(0, 1)
        v = (x @ t[f"{prefix}.v_proj.weight"].T).view(n, kv_heads, hd).transpose(0, 1)
        freqs = torch.arange(start, start + n)[:, None] * (1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2) / hd))[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rope(z):
            return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

        q, k = rope(q), rope(k).repeat_interleave(heads // kv_heads, 0)
        scores = (q @ k.transpose(1, 2)) / hd ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
        out = scores.softmax(-1) @ v.repeat_interleave(heads // kv_heads, 0)
        return out.transpose(0, 1).reshape(n, -1) @ t[f"{prefix}.o_proj.weight"].T

    def _mlp(self, x, prefix):
        t = self.t
        gate, up = x @ t[f"{prefix}.gate_proj.weight"].T, x @ t[f"{prefix}.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ t[f"{prefix}.down_proj.weight"].T

    def run(self, tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
        """Outputs at positions start, start + 1, ... for inputs (tokens[i], feats[i])."""
        t = self.t
        e = self.target.model.embed_tokens(torch.tensor(tokens)).detach()
        if self.layout == "EAGLE":
            h = torch.cat([e, feats], -1) @ t["fc.weight"].T + t["fc.bias"]
            h = h + self._attention(h, "layers.0.self_attn", start)
            return h + self._mlp(self._rms(h, t["layers.0.post_attention_layernorm.weight"]), "layers.0.mlp")
        x = torch.cat([self._rms(e, t["midlayer.input_layernorm.weight"]),
                       self._rms(feats, t["midlayer.hidden_norm.weight"])], -1)
        h = feats + self._attention(x, "midlayer.self_attn", start)
        return h + self._mlp(self._rms(h, t["midlayer.post_attention_layernorm.weight"]), "midlayer.mlp")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.layout == "EAGLE":
            return self.target.lm_head(h).detach()
        out = torch.full((320,), float("-inf"))
        ids = torch.arange(self.t["d2t"].shape[0]) + self.t["d2t"]
        out[ids] = self._rms(h, self.t["norm.weight"]) @ self.t["lm_head.weight"].T
        return out

    def path_logits(self, committed: list[int], path: list[int], start: int = 0) -> torch.Tensor:
        """Draft logits after the committed tokens (the last one is the root), then after each
        drafted token of `path`, whose feature is the draft's own output before it. The draft's
        context starts at position `start`."""
        tokens, feats = committed[start + 1:], self.features(committed[:-1])[start:]
        out = []
        for i in range(len(path) + 1):
            h = self.run(tokens, feats, start)
            out.append(self.logits(h[-1]))
            if i < len(path):
                tokens, feats = tokens + [path[i]], torch.cat([feats, h[-1:]])
        return torch.stack(out)
