"""Top-N activating contexts per unit, merged batch by batch with tensor ops (no per-token Python heaps).

State per layer, bounded by units × N (× the context window W = left + 1 + right):

    values   (U, N)     the N largest activations seen so far per unit, descending; -inf where fewer fired
    where    (U, N, 2)  (global sequence id, position) of each of them
    domain   (U, N)     corpus index of each of them
    tokens   (U, N, W)  token ids of the window around each peak (-1 beyond the sequence's ends)
    acts     (U, N, W)  the unit's activation on every token of that window (0 where it did not fire)

One context per stretch of text (non-maximum suppression, as activation dashboards keep it): a firing is a context's
peak only when the unit's activation there is the highest within R = left + right tokens on either side in the same
sequence (ties: the earlier token wins). So no two contexts of a unit share a token of their windows, and no window
shows a higher activation than its own peak. A sequence never spans two batches, so the suppression is done per
batch, before the merge, and the result is the same for every batch size.

One merge per batch: the batch's peaks are ranked within each unit by two stable sorts (value, then unit), the first
N of each unit are scattered into a (U, N) candidate table, and `cat + topk` over (U, 2N) keeps the best N. Windows
are gathered only for the batch's new winners. Ties between equal activations keep the earlier token.
"""

import torch

WINDOW_CHUNK = 16_384
"""Winners whose windows are gathered at once: bounds the (chunk, W, K) comparison tensor."""


class TopContexts:
    """Running top-N contexts of every unit of one sparse layer; see the module docstring for the state."""

    def __init__(self, num_units: int, top_n: int, left: int, right: int, device: torch.device | str = "cpu") -> None:
        U, N, W = num_units, top_n, left + 1 + right
        self.num_units, self.top_n, self.left, self.right = U, N, left, right
        self.values = torch.full((U, N), float("-inf"), device=device)
        self.where = torch.full((U, N, 2), -1, dtype=torch.long, device=device)
        self.domain = torch.full((U, N), -1, dtype=torch.long, device=device)
        self.tokens = torch.full((U, N, W), -1, dtype=torch.long, device=device)
        self.acts = torch.zeros((U, N, W), device=device)

    @property
    def window(self) -> int:
        return self.left + 1 + self.right

    def update(
        self,
        unit: torch.Tensor,
        value: torch.Tensor,
        token: torch.Tensor,
        input_ids: torch.Tensor,
        code_index: torch.Tensor,
        code_weights: torch.Tensor,
        domain: int,
        first_sequence: int,
    ) -> None:
        """Merge one batch.

        unit, value, token: (P,) the batch's firing pairs (unit id, activation, flat token index b·T + t), each
        (unit, token) at most once; input_ids (B, T); code_index / code_weights (B·T, K) the layer's code for the
        batch; `domain` the batch's corpus index; `first_sequence` the global id of the batch's first sequence.
        """
        peak = local_peaks(unit, value, token, input_ids.shape[1], self.left + self.right)
        # Pairs not above their unit's current N-th value cannot enter (ties keep the earlier, old entry).
        enter = peak & (value > self.values[unit, -1])
        unit, value, token = unit[enter], value[enter], token[enter]
        if unit.numel() == 0:
            return
        U, N = self.num_units, self.top_n
        # Rank the pairs within each unit: by value (descending, earlier token first on ties), then group by unit.
        order = torch.sort(value, descending=True, stable=True).indices  # (P,)
        order = order[torch.sort(unit[order], stable=True).indices]  # (P,) grouped by unit, by value inside
        u, v, t = unit[order], value[order], token[order]
        counts = torch.bincount(u, minlength=U)  # (U,)
        starts = torch.cumsum(counts, 0) - counts  # (U,) first slot of each unit's run
        rank = torch.arange(u.numel(), device=u.device) - starts[u]  # (P,) rank within its unit
        keep = rank < N
        u, v, t, rank = u[keep], v[keep], t[keep], rank[keep]
        # Only units whose best candidate beats their current N-th value change (few, once the tables have filled).
        best_new = torch.full((U,), float("-inf"), device=v.device)
        best_new[u[rank == 0]] = v[rank == 0].to(best_new.dtype)
        changed = (best_new > self.values[:, -1]).nonzero().squeeze(-1)  # (R,) unit ids
        if changed.numel() == 0:
            return
        row_of = torch.full((U,), -1, dtype=torch.long, device=v.device)
        row_of[changed] = torch.arange(changed.numel(), device=v.device)
        r = row_of[u]
        use = r >= 0
        r, v, t, rank = r[use], v[use], t[use], rank[use]
        R = changed.numel()
        cand_values = torch.full((R, N), float("-inf"), device=self.values.device)
        cand_values[r, rank] = v.to(cand_values.dtype)
        cand_token = torch.full((R, N), -1, dtype=torch.long, device=self.values.device)
        cand_token[r, rank] = t

        # Merge with the running rows; old entries come first, so on ties they (earlier tokens) are kept.
        merged = torch.cat([self.values[changed], cand_values], dim=1)  # (R, 2N)
        best, pick = _stable_topk(merged, N)  # (R, N) each
        from_batch = pick >= N  # (R, N) winners that are new
        keep_old = pick.clamp_max(N - 1)
        W = self.window
        self.values[changed] = best
        self.where[changed] = self.where[changed].gather(1, keep_old[..., None].expand(-1, -1, 2))
        self.domain[changed] = self.domain[changed].gather(1, keep_old)
        self.tokens[changed] = self.tokens[changed].gather(1, keep_old[..., None].expand(-1, -1, W))
        self.acts[changed] = self.acts[changed].gather(1, keep_old[..., None].expand(-1, -1, W))

        local, slots = from_batch.nonzero(as_tuple=True)  # (M,) each
        new_token = cand_token[local, pick[local, slots] - N]  # (M,) flat token index in the batch
        rows = changed[local]  # (M,) unit ids
        T = input_ids.shape[1]
        seq, pos = new_token // T, new_token % T
        self.where[rows, slots] = torch.stack([seq + first_sequence, pos], dim=-1)
        self.domain[rows, slots] = domain
        for lo in range(0, rows.numel(), WINDOW_CHUNK):
            sl = slice(lo, lo + WINDOW_CHUNK)
            tok, act = self._windows(rows[sl], seq[sl], pos[sl], input_ids, code_index, code_weights)
            self.tokens[rows[sl], slots[sl]] = tok
            self.acts[rows[sl], slots[sl]] = act

    def _windows(
        self,
        unit: torch.Tensor,
        seq: torch.Tensor,
        pos: torch.Tensor,
        input_ids: torch.Tensor,
        code_index: torch.Tensor,
        code_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and the unit's activations around each peak: unit, seq, pos (M,) -> (M, W) each."""
        T = input_ids.shape[1]
        offsets = torch.arange(-self.left, self.right + 1, device=pos.device)  # (W,)
        at = pos[:, None] + offsets  # (M, W)
        inside = (at >= 0) & (at < T)
        at = at.clamp(0, T - 1)
        tokens = input_ids[seq[:, None], at].masked_fill(~inside, -1)  # (M, W)
        flat = seq[:, None] * T + at  # (M, W) rows of the code
        hit = code_index[flat] == unit[:, None, None]  # (M, W, K)
        acts = (code_weights[flat].float() * hit).sum(-1).masked_fill(~inside, 0.0)  # (M, W)
        return tokens, acts


def local_peaks(unit: torch.Tensor, value: torch.Tensor, token: torch.Tensor, T: int, radius: int) -> torch.Tensor:
    """(P,) bool: whether each firing pair is the highest of its unit within `radius` tokens on either side in the
    same sequence (of length T; flat token index b·T + t), ties going to the earlier token. Non-firing tokens count
    as 0, below every firing. unit, value, token: (P,), each (unit, token) at most once."""
    if radius <= 0 or unit.numel() == 0:
        return torch.ones_like(unit, dtype=torch.bool)
    span = int(token.max()) + 1 + radius  # keys of different units never meet, even at a neighbour's offset
    key = unit * span + token  # (P,) unique
    order = torch.argsort(key)
    sorted_key, sorted_value = key[order], value[order]  # (P,) each
    position = token % T
    peak = torch.ones_like(unit, dtype=torch.bool)
    for offset in range(-radius, radius + 1):
        if offset == 0:
            continue
        inside = (position + offset >= 0) & (position + offset < T)  # the neighbour is in the same sequence
        at = torch.searchsorted(sorted_key, key + offset).clamp_max(key.numel() - 1)  # (P,)
        found = inside & (sorted_key[at] == key + offset)
        other = sorted_value[at]
        beaten = (other > value) | ((other == value) & (offset < 0))
        peak &= ~(found & beaten)
    return peak


def _stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk along dim 1 that prefers lower column indices among equal values: (R, C) -> (R, k) each."""
    sorted_values, order = torch.sort(values, dim=1, descending=True, stable=True)
    return sorted_values[:, :k], order[:, :k]
