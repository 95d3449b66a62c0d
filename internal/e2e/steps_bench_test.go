package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/capstan-dev/capstan/internal/steps"
)

// BenchmarkStepsConsumerMemory runs a whole file of 10,000 and of 100,000
// generated payments as one execution through the daemons as processes
// (window 128, the example provider on the kafka transport, kfake and
// PostgreSQL) and reports the consumer process's peak resident memory
// (VmHWM) next to its resident memory when idle, and rows per second. The
// session holds at most the window's items, so the peak must not grow with
// the file. Run:
//
//	go test -run '^$' -bench StepsConsumerMemory -benchtime 1x -timeout 30m ./internal/e2e/
func BenchmarkStepsConsumerMemory(b *testing.B) {
	for _, rows := range []int{10_000, 100_000} {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) {
			s := newStack(b, stackOptions{Steps: true, StepsWindow: 128, RetryableFraction: -1,
				ProviderLatencyMin: time.Millisecond, ProviderLatencyMax: 5 * time.Millisecond, SessionTimeout: 3 * time.Second})
			writePayments(b, filepath.Join(s.objects, stepsSource), rows)
			s.startStepsProvider()
			s.startGateway()
			s.startDispatcher()
			s.startRouter()
			c := s.startConsumer("consumer-1")
			idle := procMemoryKiB(b, c.pid(), "VmRSS")
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < b.N; i++ {
				in, _ := json.Marshal(steps.Input{Source: stepsSource, Output: fmt.Sprintf("e2e-failures/out/%d.csv", i)})
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				resp, err := s.client.Invoke(ctx, stepsCapability, in, "application/json", "bench-"+strconv.Itoa(i))
				cancel()
				require.NoError(b, err)
				require.Equal(b, "SUCCEEDED", s.waitSettled(b, resp.GetExecutionId(), 30*time.Minute))
			}
			elapsed := time.Since(start)
			peak := procMemoryKiB(b, c.pid(), "VmHWM")
			b.ReportMetric(float64(rows*b.N)/elapsed.Seconds(), "rows/s")
			b.ReportMetric(float64(peak)/1024, "peak_MiB")
			b.ReportMetric(float64(idle)/1024, "idle_MiB")
		})
	}
}

// writePayments writes n generated payments (unique IDs, a spread of
// amounts and currencies, so some are declined or unsupported) as CSV.
func writePayments(b testing.TB, path string, n int) {
	b.Helper()
	require.NoError(b, os.MkdirAll(filepath.Dir(path), 0o755))
	f, err := os.Create(path)
	require.NoError(b, err)
	w := bufio.NewWriter(f)
	fmt.Fprintln(w, "ID,Recipient,Amount,Currency")
	currencies := []string{"AUD", "EUR", "USD", "GBP", "JPY", "KRW", "ZAR", "INR"}
	for i := 1; i <= n; i++ {
		cents := (i * 7919) % 1_000_000
		fmt.Fprintf(w, "%d,Recipient %d,%d.%02d,%s\n", i, i%977, cents/100, cents%100, currencies[i%len(currencies)])
	}
	require.NoError(b, w.Flush())
	require.NoError(b, f.Close())
}

// procMemoryKiB reads a memory field (VmRSS, VmHWM) of /proc/<pid>/status.
func procMemoryKiB(b testing.TB, pid int, field string) int {
	b.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(b, err)
	for line := range strings.SplitSeq(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			require.NoError(b, err)
			return n
		}
	}
	b.Fatalf("%s not in /proc/%d/status", field, pid)
	return 0
}
