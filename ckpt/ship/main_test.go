package ship

import (
	"os"
	"testing"

	"github.com/ftkit/ftkit/internal/testenv"
)

// TestMain runs the tests in a mount namespace of their own: xfsMount's file systems must reach no lab job
// running beside them.
func TestMain(m *testing.M) {
	testenv.InPrivateMountNamespace()
	os.Exit(m.Run())
}
