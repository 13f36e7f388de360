"""One attention call from its forward to its backward: the record (record), the backward plan made
at the forward (plan), and the router that carries the plan out (router).
"""
