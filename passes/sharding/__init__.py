"""Sharding: what one mesh axis can do with each node — :class:`Strategy` and :class:`OpView`
(``strategies``) and the rule table of ops to their strategies (``rules``; autopar's own composite
ops' rules in ``composite``)."""
