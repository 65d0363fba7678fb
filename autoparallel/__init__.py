"""autoparallel: strict dynamo capture with AC tags and mixed precision, DTensor parallel module."""
