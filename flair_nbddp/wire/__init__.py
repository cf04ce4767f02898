"""What crosses between the notebook and the workers: the messages (``events``), the packed call
(``payload``), flair corpora in compact bytes (``codec``) and read back one sentence at a time
(``lazy_corpus``), and the few bytes that stand for an object already put on a pool (``pool_ref``).

Both sides import it; it imports nothing of the kit but :mod:`flair_nbddp.errors`.
"""
