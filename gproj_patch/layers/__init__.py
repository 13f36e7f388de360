"""Which layer an attention call belongs to: the layer scope and step numbering (scope), names after
the model's modules (tracking).
"""
