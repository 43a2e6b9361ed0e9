-- One audit log for the whole system: the gates' events and every front end's (who did
-- what, refused or allowed). `origin` says which part wrote an entry.
ALTER TABLE gate_audit RENAME TO audit_log;
ALTER TABLE audit_log ADD COLUMN origin TEXT NOT NULL DEFAULT 'gates';
DROP INDEX IF EXISTS gate_audit_task;
CREATE INDEX audit_log_task ON audit_log (task, id);
CREATE INDEX audit_log_origin ON audit_log (origin, id);
