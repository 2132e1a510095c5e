from ....hooks import BlockView, KVCompressor


class KeepAll(KVCompressor):
    def keep(self, view: BlockView) -> list[int]:
        return list(range(view.num_blocks))
