"""How samples become packed rows: the prefix-trie layout, the index work recurrent layers need on
it, the attention backend a row is cheapest with, and a row's model FLOPs.
"""
