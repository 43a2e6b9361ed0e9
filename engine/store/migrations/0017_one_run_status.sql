-- runs.status is a run's one status: an auto run's cursor (state_json) kept a second one
-- ("status", written by json.dumps beside the cursor's other keys), which could disagree
-- with the column (a failed turn left it "running"). It is taken out of every auto run's
-- cursor; the code reads the status from the column only.
UPDATE runs SET state_json =
    REPLACE(REPLACE(REPLACE(REPLACE(REPLACE(REPLACE(REPLACE(REPLACE(state_json,
        '"status": "running", ', ''), '"status": "completed", ', ''),
        '"status": "stopped", ', ''), '"status": "error", ', ''),
        ', "status": "running"', ''), ', "status": "completed"', ''),
        ', "status": "stopped"', ''), ', "status": "error"', '')
WHERE mode = 'auto' AND state_json LIKE '%"status": "%';
