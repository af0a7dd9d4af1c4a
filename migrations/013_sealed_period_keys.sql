-- A period key's secret is kept sealed (billing/sealing.py, with BILLING_KEY_ENCRYPTION_KEYS):
-- whoever reads this database or its backups cannot charge with it. A row written before
-- keeps its plain `secret` until a worker first reads it and seals it in place.
ALTER TABLE period_vault_keys
    ALTER COLUMN secret DROP NOT NULL,
    ADD COLUMN sealed_secret bytea,
    ADD CONSTRAINT period_vault_keys_one_secret
        CHECK ((secret IS NULL) <> (sealed_secret IS NULL));
