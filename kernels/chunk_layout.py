"""The real chunks of each request of a varlen call, for the chunked scans on CPU (SSD, GDN).

A request of L tokens owns ceil(L / chunk) consecutive chunks; only its last one is padded (with
zeros). The chunks of all requests are packed one after another, so the intra-chunk work of a
call is proportional to its tokens, not to (requests x the longest request's chunk count).
Only the chunk-to-chunk state recurrence is sequential: it steps over chunk index k, batched
over the requests that have a chunk k.
The layers of one step pass the same requests: `ChunkLayout.of(spans, chunk, device)` keeps the
last few layouts by value, so a step builds each layout once, not once per layer.
"""
from __future__ import annotations

import torch


class ChunkLayout:
    """spans: `varlen.request_spans` output; chunk: chunk size > 0.

    num_chunks C; token_chunk / token_pos [T] long: where packed token t sits;
    dest [T]: its row in the padded [C * chunk] layout; first [R] / count [R]: each request's
    first chunk and chunk count; slots [R] long, init [R] bool; upper [chunk, chunk] bool
    (True strictly above the diagonal: s > l, the future inside a chunk); _steps[k] the chunk ids
    of index k of every request that has one, step_requests[k] those requests (None: all).
    """

    @classmethod
    def of(cls, spans, chunk: int, device) -> "ChunkLayout":
        """The layout of these spans, from the last few built (a layout is never modified after
        it is built; the C kernels' index tables are added to it once)."""
        key = (tuple(spans), chunk, str(device))
        for i, (k, lay) in enumerate(_RECENT):
            if k == key:
                _RECENT.insert(0, _RECENT.pop(i))
                return lay
        lay = cls(spans, chunk, device)
        _RECENT.insert(0, (key, lay))
        del _RECENT[_KEEP:]
        return lay

    def __init__(self, spans, chunk: int, device):
        self.chunk, self.device = chunk, device
        lengths = [e - s for s, e, _, _ in spans]
        count = [-(-n // chunk) for n in lengths]
        first, c = [], 0
        for n in count:
            first.append(c)
            c += n
        self.num_chunks, self.count_list, self.first_list = c, count, first
        self.num_tokens = sum(lengths)
        self.first = torch.tensor(first, dtype=torch.long, device=device)
        self.count = torch.tensor(count, dtype=torch.long, device=device)
        self.slots = torch.tensor([s for _, _, s, _ in spans], dtype=torch.long, device=device)
        self.init_list = [bool(i) for *_, i in spans]
        self.init = torch.tensor(self.init_list, dtype=torch.bool, device=device)
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        starts = torch.tensor([s for s, _, _, _ in spans], dtype=torch.long, device=device)
        req = torch.repeat_interleave(torch.arange(len(spans), device=device), lens)
        offset = torch.arange(self.num_tokens, device=device) - (torch.cumsum(lens, 0) - lens)[req]
        self.rows = starts[req] + offset  # packed row of each token
        self.identity = bool((self.rows == torch.arange(self.num_tokens, device=device)).all())
        self.token_chunk = self.first[req] + offset // chunk
        self.token_pos = offset % chunk
        self.dest = self.token_chunk * chunk + self.token_pos
        self.upper = torch.ones(chunk, chunk, dtype=torch.bool, device=device).triu(1)
        self._source_rows = self._padded_row_of = None  # built when first asked for (C kernels)
        self.step_requests = [None if all(n > k for n in count) else
                              torch.tensor([r for r, n in enumerate(count) if n > k], dtype=torch.long,
                                           device=device) for k in range(max(count, default=0))]
        self._steps = [torch.tensor([f + k for f, n in zip(first, count) if n > k], dtype=torch.long,
                                    device=device) for k in range(max(count, default=0))]

    @property
    def source_rows(self) -> torch.Tensor:
        """[C * chunk] long: the packed token row at each padded row, -1 in the padding."""
        if self._source_rows is None:
            self._source_rows = torch.full((self.num_chunks * self.chunk,), -1, dtype=torch.long,
                                           device=self.device).index_copy_(0, self.dest, self.rows)
        return self._source_rows

    def padded_row_of(self, num_rows: int) -> torch.Tensor:
        """[num_rows] long: the padded row of each packed row of a call's tensors, -1 for a row no
        request covers."""
        if self._padded_row_of is None or self._padded_row_of.shape[0] != num_rows:
            self._padded_row_of = torch.full((num_rows,), -1, dtype=torch.long,
                                             device=self.device).index_copy_(0, self.rows, self.dest)
        return self._padded_row_of

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """t [T_all, F] packed tokens -> fp32 [C * chunk, F]: each request's tokens in its chunks,
        zeros in the padding."""
        out = torch.zeros(self.num_chunks * self.chunk, t.shape[1], dtype=torch.float32,
                          device=t.device)
        src = t if self.identity and t.shape[0] == self.num_tokens else t[self.rows]
        return out.index_copy_(0, self.dest, src.float())

    def pad_heads(self, t: torch.Tensor) -> torch.Tensor:
        """t [T_all, Hd, F] packed tokens -> fp32 [C, Hd, chunk, F], heads first, zeros in the
        padding (one copy: the tokens are written straight into the chunk layout)."""
        out = torch.zeros(self.num_chunks, t.shape[1], self.chunk, t.shape[2], dtype=torch.float32,
                          device=t.device)
        src = t if self.identity and t.shape[0] == self.num_tokens else t[self.rows]
        out[self.token_chunk, :, self.token_pos] = src.float()
        return out

    def chain(self, ends: torch.Tensor, decay: torch.Tensor, h0: torch.Tensor):
        """The chunk-to-chunk recurrence E_c = decay_c E_(c-1) + ends_c, E_(-1) = h0 of the request.

        ends [C, ...] (each chunk's own inputs at its end; overwritten with E); decay [C, H]
        (the chunk's total decay, broadcast over the state's trailing dims); h0 [R, ...].
        h0 must be zero for requests without an initial state (`init` False): their first chunk
        is not touched. Returns (starts [C, ...]: the state entering each chunk, finals [R, ...]:
        the state after each request's last chunk, h0 for a request without tokens).
        """
        tail = (1,) * (ends.dim() - decay.dim())
        d = decay.view(*decay.shape, *tail)
        has = [r for r, n in enumerate(self.count_list) if n]
        # the first chunk of a request that starts from zeros needs nothing: E_0 = ends_0
        warm = [r for r in has if self.init_list[r]]
        if warm:
            cur = self.first[torch.tensor(warm, device=h0.device)]
            prev = h0.index_select(0, torch.tensor(warm, device=h0.device))
            ends.index_copy_(0, cur, prev.mul_(d.index_select(0, cur)).add_(ends.index_select(0, cur)))
        for cur in self._steps[1:]:
            prev = ends.index_select(0, cur - 1)
            ends.index_copy_(0, cur, prev.mul_(d.index_select(0, cur)).add_(ends.index_select(0, cur)))
        starts = torch.empty_like(ends)
        if self.num_chunks > 1:
            starts[1:] = ends[:-1]
        if has:
            idx = torch.tensor(has, device=h0.device)
            starts.index_copy_(0, self.first[idx], h0.index_select(0, idx))
        finals = h0.clone()
        if has:
            finals.index_copy_(0, idx, ends.index_select(0, self.first[idx] + self.count[idx] - 1))
        return starts, finals

    def position(self, request: int, p: int) -> tuple[int, int]:
        """(chunk, offset in it) of the request's token p - 1 (p in 1..len)."""
        return self.first_list[request] + (p - 1) // self.chunk, (p - 1) % self.chunk


_KEEP = 4  # layouts kept: a step's one or two chunk sizes, with room to spare
_RECENT: list = []
