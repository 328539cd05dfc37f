"""OpenAI's Files and Batch APIs underneath their routes: uploaded files and a batch's output files
kept in a directory (`files`), an input file's checks, the batch object and the journal that lets
a batch resume after a restart (`batches`), and the loop that runs a batch's requests through a
`send` function to its end (`runner`). The HTTP routes and the replica's runner loop are not
built yet."""
