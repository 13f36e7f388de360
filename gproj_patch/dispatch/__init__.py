"""One attention call from its forward to its backward: the record (record), the backward plan made
at the forward (plan), the router that carries the plan out (router), and what every hook shares on that way: a
boolean mask as the call's problem (masks), autograd's questions around a hooked call (autograd).
"""
