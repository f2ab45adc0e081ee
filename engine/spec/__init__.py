"""Speculative rounds: drafters propose tokens, one batched round verifies them.

A decode round is bound by streaming the weights once, so checking a few extra
rows per lane costs little (docs/PERFORMANCE.md). Each speculating lane carries
``k`` proposed tokens; the round runs its ``k + 1`` rows (the last committed
token, then the drafts) and samples every row with the ordinary sampler at its
own position. The lane keeps the drafts up to the first row whose sampled token
differs from the next draft, plus that row's token: between 1 and ``k + 1``
tokens a round.

Lossless by construction for the drafters that propose single tokens (prompt
lookup, Predicted Outputs): row ``j`` sees exactly the context the
non-speculative lane would have had at that position (the drafts before it
were accepted), and the sampler draws it with the uniform keyed by
``(seed, position)``, so the committed tokens are the ones speculation off
would give, greedy or sampled. For a proposal with a distribution ``q`` (a
draft model sampling), :mod:`engine.spec.verify` has the standard acceptance
rule (accept with ``min(1, p/q)``, else draw from ``max(p - q, 0)``).

Modules: ``drafters`` (the interface, prompt lookup, Predicted Outputs),
``verify`` (acceptance), ``adaptive`` (k per lane from its acceptance
history), ``loop_guard`` (a reasoning loop detector that asks the engine to
take the loop back), ``reasoning`` (the reasoning channel a request is in,
its budget and its guard), ``rounds`` (all of it as the scheduler runs it).
"""
