"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min. No torch."""

from __future__ import annotations


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` proposed next tokens of `token_ids` (prompt and output), [] when no n-gram recurs."""
    total = len(token_ids)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = token_ids[total - n:]
        first, short = suffix[0], None
        # The latest match followed by k tokens, else the latest match (a token at least after it).
        for i in range(total - n - 1, -1, -1):
            if token_ids[i] == first and token_ids[i:i + n] == suffix:
                if i + n + k <= total:
                    return token_ids[i + n:i + n + k]
                short = short or token_ids[i + n:i + n + k]
        if short:
            return short
    return []
