// Package e2e holds Capstan's end-to-end tests: they build the daemons and
// the csv-payments example, start them as separate OS processes through
// `capstanctl dev` on a real PostgreSQL and an embedded Kafka, and check
// the outcome of real input files.
package e2e
