-- Each proxied request's own id on its audit row: the vault retries the audit insert through
-- a database outage, and a first try may have committed before its connection dropped. The
-- retry then finds the row and writes nothing, so a request is audited once.
ALTER TABLE vault_audit ADD COLUMN request_id uuid UNIQUE;
