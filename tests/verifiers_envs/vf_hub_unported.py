"""A hub environment as written for verifiers 0.1-0.3, not ported: verifiers 0.4 has no `vf.Environment`,
`vf.SingleTurnEnv`, ... (its API is `verifiers.v1`), so this fails to load; Gyre's error says how to port it."""

import verifiers as vf


def load_environment(**kwargs) -> vf.Environment:  # evaluated at import: AttributeError on verifiers 0.4
    return vf.SingleTurnEnv(dataset=[{"question": "ab", "answer": "ba"}], **kwargs)
