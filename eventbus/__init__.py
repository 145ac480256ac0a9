"""eventbus: the wire schema, block identity, topic administration and Kafka helpers.

The ground floor of kvflow: it imports no other kvflow package, and every other package that
speaks to Kafka or names a block imports it.
"""
