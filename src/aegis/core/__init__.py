"""The pure core: phases, job model, events, actions and the ``step`` function.

Nothing here performs I/O, reads a clock, logs or uses asyncio. Time is an argument.
"""
