"""The engines the bench compares: kvchat itself and its peers, one file each.

Every engine answers the same small interface (`base.py`): a chat that keeps
sessions the way that engine's users keep them, a speed measurement, and a
batched generation where the engine has one. A peer whose package is missing
is skipped with a message that says how to install it.
"""
