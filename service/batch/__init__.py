"""OpenAI's Files and Batch APIs: uploaded files and a batch's output files kept in a directory the
replicas of a node share (`files`), an input file's checks, the batch object and the journal that
lets a batch resume after a restart (`batches`), the calls of the API and the run of a batch's
requests through a `send` function to its end (`runner`), and the routes on a replica's app with
the loop that runs batches there, each request through the replica's own endpoint (`api`)."""
