-- 0004: reserved for the lock-secret migration made on another branch; this placeholder only
-- keeps the numbering without gaps on this branch. DROP THIS FILE WHEN MERGING that branch.
SELECT 1;
