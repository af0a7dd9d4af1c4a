-- A worker whose attempt met a 500 Stripe saved for its key, with no charge made, fences off
-- the claim's earlier attempts through the admin API (vault/admin.py fence): one of them held
-- up for hours (a frozen worker) could otherwise send the key after Stripe forgot it, once a
-- cancel or skip was recorded. The key's audit records each fence ('fenced'), with its token.
ALTER TABLE vault_audit DROP CONSTRAINT vault_audit_decision_check;
ALTER TABLE vault_audit ADD CONSTRAINT vault_audit_decision_check CHECK (decision IN (
    'forwarded', 'replayed', 'refused_auth', 'refused_endpoint', 'refused_request',
    'refused_cap', 'refused_daily_cap', 'refused_in_flight', 'issued', 'revoked', 'resolved',
    'fenced'))
    NOT VALID;
ALTER TABLE vault_audit DROP CONSTRAINT vault_audit_actor_of_admin_calls;
ALTER TABLE vault_audit ADD CONSTRAINT vault_audit_actor_of_admin_calls
    CHECK ((actor IS NOT NULL) = (decision IN ('issued', 'revoked', 'resolved', 'fenced')))
    NOT VALID;
