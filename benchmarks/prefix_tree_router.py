"""Ray Serve LLM's PrefixCacheAffinityRouter policy, reimplemented from its documentation (benchmark baseline).

Ray Serve LLM itself needs `ray[llm]` (vLLM), which this machine cannot install. The documented policy:
if the replicas' queue lengths differ by less than `imbalanced_threshold` (10), route to the replica whose
previously routed texts share the longest character prefix with this one, when that match is at least
`match_rate_threshold` (0.1) of the text, else to the replica with the fewest routed characters; when
imbalanced, power of two choices. Lives in its own module so Ray Serve can import it in the front replica.
"""
from __future__ import annotations

import json
import os
import random

from ray.serve.request_router import RequestRouter


class PrefixTreeAffinityRouter(RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = 10, match_rate_threshold: float = 0.1) -> None:
        self.imbalanced_threshold, self.match_rate_threshold = imbalanced_threshold, match_rate_threshold
        self.texts: dict[str, list[str]] = {}
        self.chars: dict[str, int] = {}
        self.pending: dict[int, str] = {}

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        text = ""  # the ingress calls generate(kind, body, routing): route on the body's text
        if pending_request is not None and len(pending_request.args) >= 2 and isinstance(pending_request.args[1], dict):
            body = pending_request.args[1]
            text = body["prompt"] if isinstance(body.get("prompt"), str) else json.dumps(body.get("messages", ""))
        qlen = {r.replica_id.unique_id: self._replica_queue_len_cache.get(r.replica_id) or 0
                for r in candidate_replicas}
        if max(qlen.values()) - min(qlen.values()) >= self.imbalanced_threshold or not text:
            pick = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            best = min(pick, key=lambda r: qlen[r.replica_id.unique_id])
        else:
            def match(r):
                best_len = 0
                for t in self.texts.get(r.replica_id.unique_id, ()):
                    n = len(os.path.commonprefix([t, text]))
                    best_len = max(best_len, n)
                return best_len
            scores = {r.replica_id.unique_id: match(r) for r in candidate_replicas}
            top = max(scores.values())
            if top / len(text) >= self.match_rate_threshold:
                ties = [r for r in candidate_replicas if scores[r.replica_id.unique_id] == top]
            else:
                low = min(self.chars.get(r.replica_id.unique_id, 0) for r in candidate_replicas)
                ties = [r for r in candidate_replicas if self.chars.get(r.replica_id.unique_id, 0) == low]
            best = random.choice(ties)
        if pending_request is not None:
            self.pending[id(pending_request)] = text
        return [[best], [r for r in candidate_replicas if r is not best]]

    def on_request_routed(self, pending_request, replica_id, result):
        text = self.pending.pop(id(pending_request), "")
        if text:
            self.texts.setdefault(replica_id.unique_id, []).append(text)
            self.chars[replica_id.unique_id] = self.chars.get(replica_id.unique_id, 0) + len(text)

