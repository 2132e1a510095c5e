from ....hooks import Proposer


class NoDraft(Proposer):
    def propose(self, request_id, token_ids, max_tokens):
        return []
