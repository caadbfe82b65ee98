"""Cost tables held still for the tests whose engines must decide alike (see own_tables in
conftest.py for the other half: a private copy of the calibration cache)."""


def one_table(eng):
    """Every engine of a test decides on the table it loaded: no correction adopted or written back
    meanwhile, and a calibration measured while other tests kept the cores busy (provisional, so
    not yet decided on: docs/exactness.md) trusted as it is."""
    policy = getattr(eng.drafter, "policy", None)
    if policy is not None:
        policy.online.persist, policy.online.PERSIST_AFTER = None, 10**9
        policy.online.prior = max(policy.online.prior, 1)
    return eng
