"""What runs inside the model's forward passes for jobs: capture (which modules can be captured, a
module's value as rows, the rows each job keeps, the step rings and the hook fallback) and edits
(interventions), behind one capture interface and one edit interface, and the rows' identity across
batches."""
