package consumer_test

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/execution"
	"github.com/capstan-dev/capstan/internal/steps"
)

// BenchmarkStepsWindow runs payments_10k.csv as one execution (ONE_TO_ONE
// over the kafka transport, an in-test partner answering at once, the
// dispatcher, consumer and completion consumer in this process on a real
// PostgreSQL and kfake) for each window size and reports rows per second
// from invocation to settlement. Run:
//
//	go test -run '^$' -bench StepsWindow -benchtime 1x ./internal/consumer/
func BenchmarkStepsWindow(b *testing.B) {
	for _, window := range []int{1, 16, 128, 1024} {
		b.Run(fmt.Sprintf("window=%d", window), func(b *testing.B) {
			dir := b.TempDir()
			copyFile(b, "../../../shared/data/csv-payments/payments_10k.csv", filepath.Join(dir, "in", "payments.csv"))
			p := startPipeline(b, noAdapter, withSteps(dir, config.OneToOne, window, paymentColumns))
			startKafkaPartner(b, p.brokers, decidePayment)
			b.ResetTimer()
			var rows int
			start := time.Now()
			for i := 0; i < b.N; i++ {
				id := p.invokeSteps(b, "in/payments.csv", fmt.Sprintf("out/%d-%s.csv", i, uuid.NewString()))
				e := p.waitSettledWithin(b, []uuid.UUID{id}, 30*time.Minute)[id]
				require.Equal(b, execution.StatusSucceeded, e.Status)
				var sum steps.Summary
				require.NoError(b, json.Unmarshal(e.Output, &sum))
				require.LessOrEqual(b, sum.MaxInFlight, window)
				rows += sum.Rows
			}
			b.ReportMetric(float64(rows)/time.Since(start).Seconds(), "rows/s")
		})
	}
}
