-- Requests to the proxy that presented no known vault key (none, or one no key row has): one
-- row per peer per window (VAULT_UNAUTHENTICATED_WINDOW_SECONDS) saying how many, instead of a
-- vault_audit row each, with which anyone who reaches the port could grow the audit log, and
-- take connections charges need, at will (vault/unauthenticated.py). `peer` is an IPv4
-- address, an IPv6 /64, or 'other' for the peers past the vault's bound on how many it counts
-- apart. A key's own refusals (revoked, expired,
-- over its cap) stay in vault_audit, one row each. Append-only for the vault's role, as
-- vault_audit is (billing/db_roles.py).
CREATE TABLE vault_unauthenticated (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    peer      text NOT NULL,
    first_at  timestamptz NOT NULL,
    last_at   timestamptz NOT NULL CHECK (last_at >= first_at),
    requests  bigint NOT NULL CHECK (requests > 0)
);

CREATE INDEX vault_unauthenticated_at ON vault_unauthenticated (first_at);
