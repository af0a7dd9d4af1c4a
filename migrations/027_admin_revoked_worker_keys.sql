-- Which token revoked a key. A worker key the admin token revoked (the kill switch on a
-- worker that may be taken over) keeps counting its whole cap against the worker budget for
-- the rest of the window, so the revoke hands no room back to the worker token; one the
-- worker token revoked (a replaced or unstored key of its own) counts only what it took.
-- Keys revoked before this migration have none: they count what they took, as before.
-- A new nullable column only: no table rewrite, no scan.
ALTER TABLE vault_keys ADD COLUMN revoked_by text;
ALTER TABLE vault_keys ADD CONSTRAINT vault_keys_revoked_by_check
    CHECK (revoked_by IN ('admin', 'worker')) NOT VALID;
