"""The developer launcher: server processes started, waited on until their health says SERVING
(probed with the server's own TLS flags), and stopped; for the tests, the benchmarks and
`make serve-prefill serve-decode stop` (`python -m launcher`)."""
