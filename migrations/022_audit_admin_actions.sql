-- The key's audit also records what was done to it through the admin API: issued, revoked,
-- and each reservation settled there (a settlement as failed frees cap room), with which
-- token did it. Written in the same transaction as the change, so a row is there exactly
-- when the change is.
--
-- The audit gets a row per proxied request: the constraints are added NOT VALID, so that
-- the migration does not hold the table's lock, and the vault's requests, while it reads
-- every row. The rows already there satisfy them: no actor, and a proxy's decision.
ALTER TABLE vault_audit ADD COLUMN actor text;
ALTER TABLE vault_audit ADD CONSTRAINT vault_audit_actor_check
    CHECK (actor IN ('admin', 'worker')) NOT VALID;
ALTER TABLE vault_audit DROP CONSTRAINT vault_audit_decision_check;
ALTER TABLE vault_audit ADD CONSTRAINT vault_audit_decision_check CHECK (decision IN (
    'forwarded', 'replayed', 'refused_auth', 'refused_endpoint', 'refused_request',
    'refused_cap', 'refused_daily_cap', 'refused_in_flight', 'issued', 'revoked', 'resolved'))
    NOT VALID;
ALTER TABLE vault_audit ADD CONSTRAINT vault_audit_actor_of_admin_calls
    CHECK ((actor IS NOT NULL) = (decision IN ('issued', 'revoked', 'resolved'))) NOT VALID;
