"""Adapters: translate a framework's lifecycle into contract calls, and an outcome into the framework's action.

* :mod:`graphsafe.adapters.distributed`: every rank of a process group ends a reload with one outcome.
"""
