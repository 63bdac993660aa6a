"""A small decoder-only transformer (GPT) for byte-level language modelling.

    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))
    logits, loss = model(x, y)                    # x, y: (B, T) int64 byte ids
    out = model.generate(prompt, 200, temperature=0.8, top_k=40)   # (B, 200) on the host

The architecture is the one GPT-2 made standard: token + learned position embeddings, then
n_layer pre-norm blocks (x + attn(ln(x)), x + mlp(ln(x))), a final LayerNorm and an output
layer that shares its weight with the token embedding. Pre-norm keeps the residual stream an
identity path, so deep stacks train without warm-up tricks; weight tying saves vocab*n_embd
parameters and ties "what a byte means" on input to "how likely it is" on output.

This file imports torch only (as nanoGPT's model.py): the training loop for it is
`labkit.lm.LMTrainer`. `adamw` builds the usual optimizer, set up so that XLA keeps one graph
for the whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes: no tokenizer to download or train
    block_size: int = 256  # longest context (positions the model has embeddings for)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers
    # activation recomputation: in training, keep only each block's input for the backward pass and run the block's
    # forward again there (GPT.recompute_fn): the saved activations drop from ~16*d floats per token per block to
    # d, for about one more forward pass of compute. Same losses and gradients
    recompute: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True  # scaled init, see GPT._init
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim): each head attends on its own slice of the channels
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal=True: position t sees positions <= t only. On XLA this lowers to plain
        # matmul + mask + softmax (no fused kernel), which XLA's compiler then fuses itself.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def forward_cached(self, x, pos, kv):
        """x (B, t, C): t new tokens at positions pos..pos+t-1 (pos: a (1,) long tensor); kv (2, B, heads,
        block_size, head_dim): this layer's keys and values, updated in place. The new tokens attend to
        every cached position up to their own; slots past them are masked out, so the cache keeps one
        shape (no new graph per token under torch.compile / torch.export)."""
        B, t, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (u.view(B, t, self.n_head, C // self.n_head).transpose(1, 2) for u in (q, k, v))
        idx = pos + torch.arange(t, device=x.device)  # (t,) absolute positions
        kv[0].index_copy_(2, idx, k)
        kv[1].index_copy_(2, idx, v)
        visible = torch.arange(kv.shape[3], device=x.device)[None, :] <= idx[:, None]  # (t, block_size)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=visible)
        return self.proj(y.transpose(1, 2).reshape(B, t, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))  # pre-norm: normalise the branch input, never the residual
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x, pos, kv):
        x = x + self.attn.forward_cached(self.ln1(x), pos, kv)
        return x + self.mlp(self.ln2(x))


def _recompute(block, x):
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


class GPT(nn.Module):
    # how a block is recomputed under cfg.recompute: fn(block, x) -> block(x), keeping x only. torch's by default;
    # on XLA set torch_xla.utils.checkpoint.checkpoint (use_reentrant=True, its only mode): its optimization
    # barrier keeps the compiler from merging the recomputed forward back into the first one (same ops on the
    # same inputs), which would keep the activations after all
    recompute_fn = staticmethod(_recompute)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.apply(self._init)

    def lm_head(self, h):
        """Output logits with the token embedding as the output matrix (weight tying).

        Tied by construction rather than by sharing one Parameter between two modules: moving
        a model to an XLA device replaces each module's Parameter separately, which silently
        unties a shared one (the output copy then gets no optimizer updates)."""
        return F.linear(h, self.wte.weight)

    def _init(self, m):
        # GPT-2's init: N(0, 0.02) everywhere; the projections that write into the residual
        # stream get std 0.02/sqrt(2*n_layer), so the stream's variance stays ~constant at init
        # however many blocks add to it (each block adds two such projections).
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual", False) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the tied matrix is one). non_embedding drops the position table,
        which is a lookup, not a matmul; the token table stays because lm_head multiplies by it."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward) at context length seq_len (default block_size).

        6*N + 12*L*T*d (Kaplan et al. 2020, as in the PaLM paper's MFU appendix): every weight does
        one multiply-add (2 FLOPs) per token forward and two in backward (grads for the input and
        for the weight), hence 6 per parameter; attention's QK^T and AV products have no weights,
        2*T*d FLOPs each per layer per token forward, times 3 for backward. Causal masking would
        halve them; the usual convention (PaLM's) counts the full T x T scores, as plain attention computes them.
        Biases and LayerNorm weights are in N, so they count 6 FLOPs each like any weight; the elementwise work of
        LayerNorms, GELU, softmax and the bias adds is not counted: a few % of the total at these sizes."""
        T = seq_len or self.cfg.block_size
        return 6 * self.num_params() + 12 * self.cfg.n_layer * T * self.cfg.n_embd

    def hidden(self, idx):
        """Final-LayerNorm activations (B, T, n_embd) for token ids idx (B, T)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        recompute = self.cfg.recompute and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = self.recompute_fn(block, x) if recompute else block(x)
        return self.ln_f(x)

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) and, when targets (B, T) are given, the mean cross-entropy in nats
        (float32 even under bf16 autocast; targets of -1 are ignored)."""
        logits = self.lm_head(self.hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def empty_cache(self, batch: int, device=None, dtype=torch.float32):
        """A zeroed key/value cache (n_layer, 2, batch, n_head, block_size, head_dim) for forward_cached."""
        c = self.cfg
        return torch.zeros(
            c.n_layer, 2, batch, c.n_head, c.block_size, c.n_embd // c.n_head, device=device, dtype=dtype
        )

    def forward_cached(self, idx, pos, cache):
        """Logits (B, vocab) of the last of the tokens idx (B, t) placed at positions pos..pos+t-1 (pos: a
        (1,) long tensor), reading and updating cache (from empty_cache) in place. t = prompt length fills
        the cache (prefill); t = 1 then costs one token's work per step instead of a whole window's."""
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(pos + torch.arange(t, device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block.forward_cached(x, pos, cache[i])
        return self.lm_head(self.ln_f(x[:, -1]))

    @torch.no_grad()
    def generate_cached(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, step=None):
        """generate() with a key/value cache, for eager/compiled CPU or GPU inference; returns (B, max_new_tokens).

        Each new token runs the model on that token alone, attending to the cached keys and values of
        the ones before: about 2*N FLOPs per token (N parameters) instead of a forward pass over the
        whole block_size window. step(idx, pos, cache) -> logits replaces self.forward_cached, e.g. a
        torch.compile'd or torch.export'ed module (positions are tensors: no recompile per token).
        Learned absolute positions cannot slide: when the cache is full, the last block_size // 2
        tokens are prefilled again (one window-sized pass per block_size // 2 tokens), so past
        block_size tokens the context right after a refill is shorter than generate()'s full window.
        Until then greedy decoding gives exactly generate()'s tokens (tested)."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k={top_k} must be between 1 and vocab_size={self.cfg.vocab_size}")
        if idx.shape[1] == 0:
            raise ValueError("generate_cached needs a prompt of at least one token")
        step = step if step is not None else self.forward_cached  # `or` would call len() on a compiled module
        T, dev = self.cfg.block_size, idx.device
        dtype = next(self.parameters()).dtype
        was_training = self.training
        self.eval()
        try:
            ctx = idx[:, -T:]
            cache = self.empty_cache(idx.shape[0], dev, dtype)
            logits = step(ctx, torch.zeros(1, dtype=torch.long, device=dev), cache)  # prefill
            n = ctx.shape[1]
            out = []
            for i in range(max_new_tokens):
                nxt = _sample(logits.float(), temperature, top_k)
                out.append(nxt)
                if i == max_new_tokens - 1:
                    break
                if n == T:  # cache full: refill it from the recent half
                    ctx = torch.cat([ctx, nxt[:, None]], 1)[:, -(T // 2) :]
                    cache.zero_()
                    logits = step(ctx, torch.zeros(1, dtype=torch.long, device=dev), cache)
                    n = ctx.shape[1]
                else:
                    ctx = torch.cat([ctx, nxt[:, None]], 1)[:, -T:]
                    logits = step(nxt[:, None], torch.full((1,), n, dtype=torch.long, device=dev), cache)
                    n += 1
        finally:
            self.train(was_training)
        return torch.stack(out, 1).cpu()

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """Continue prompts idx (B, T0) by max_new_tokens bytes; returns them as a (B, max_new_tokens)
        CPU tensor. temperature 0 (or top_k=1) is greedy decoding.

        Written for XLA, where every new graph is a compile (seconds on a TPU, tens on big models):
        - The model always runs on a fixed (B, block_size) window kept on the device. Growing
          the input by one token per step (the textbook loop) would be a new shape, hence a new
          compile, for every token until the window is full.
        - While the window fills, the position to read and write is a device tensor, not a Python
          int: the graph is identical at every step, only the data changes. Once full, the window
          slides left by one (a second graph). So two step graphs in all, however many tokens.
        - Sampling stays on the device (Gumbel-max: argmax(logits/temperature + Gumbel noise) draws
          from softmax(logits/temperature); top_k masks with a fixed k). torch.multinomial may run
          on the CPU under XLA, and .item() per token would stop the device every step.
        - Each step ends with a sync, which cuts the lazy graph (otherwise it would grow by a whole
          forward pass per token); the tokens come to the host once, at the end.
        Costs: every step computes the full window even while it is mostly padding (causal
        attention makes the padding after the read position invisible to it), and there is no
        key/value cache, so each token costs a full forward pass over block_size positions
        (generate_cached has one; it suits eager/compiled CPU and GPU inference)."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k={top_k} must be between 1 and vocab_size={self.cfg.vocab_size}")
        dev, T = idx.device, self.cfg.block_size
        sync = _sync_fn(dev)
        B, n = idx.shape[0], min(idx.shape[1], T)
        if n == 0:
            raise ValueError("generate needs a prompt of at least one token")
        buf = F.pad(idx[:, -n:], (0, T - n))  # (B, T): prompt, then padding
        cols = torch.arange(T, device=dev).unsqueeze(0)
        out = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
        out_cols = torch.arange(max_new_tokens, device=dev).unsqueeze(0)
        pos = torch.full((1,), n, dtype=torch.long, device=dev)  # tokens in the window (device)
        step = torch.zeros((1,), dtype=torch.long, device=dev)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                full = n >= T  # host-side: picks the graph
                h = self.hidden(buf)
                h = h[:, -1:] if full else h.index_select(1, pos - 1)
                nxt = _sample(self.lm_head(h)[:, 0].float(), temperature, top_k)  # (B,)
                out = torch.where(out_cols == step, nxt[:, None], out)
                step = step + 1
                if full:
                    buf = torch.cat([buf[:, 1:], nxt[:, None]], dim=1)
                else:
                    buf = torch.where(cols == pos, nxt[:, None], buf)
                    pos = pos + 1
                    n += 1
                sync()
        finally:
            self.train(was_training)
        return out.cpu()  # the one device->host transfer


def _sample(logits, temperature: float, top_k: int | None):
    """One token id per row, computed on the device without data-dependent shapes."""
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    u = torch.rand_like(logits).clamp_(1e-10, 1.0 - 1e-7)  # clamp: log(0) would be -inf
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


def _sync_fn(device):
    if device.type == "xla":
        import torch_xla

        return torch_xla.sync
    return lambda: None


def adamw(model, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), *, rt) -> torch.optim.AdamW:
    """AdamW as GPTs are usually trained: weight decay on matrices only (not on biases, LayerNorm
    gains), `capturable=True` where the backend traces the step into a graph (rt.capturable_optimizers: XLA), and
    `fused=True` on CUDA (rt.adamw_options: one kernel for the whole update instead of a few per tensor).

    Why capturable on XLA: plain AdamW computes its bias corrections, e.g. sqrt(1 - beta2**step),
    as Python floats on the host. torch_xla sends most Python numbers to the device as data, but
    bakes 0 and 1 into the graph as constants; once the correction rounds to exactly 1.0 in
    float32 (step ~325 for beta2=0.95, ~16,600 for 0.999) the graph changes and XLA recompiles
    mid-run (measured in tests/test_gpt.py). capturable keeps the step count on the device and
    computes the corrections there: one graph for the whole run, for a few more ops per step."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **rt.adamw_options())  # + fused=True on CUDA


def bits_per_byte(nats_per_token: float) -> float:
    """Cross-entropy in nats per byte -> bits per byte (the usual unit for byte/char models)."""
    return nats_per_token / math.log(2)
