#include "client/cli/command.h"

int main(int argc, char** argv) { return ctxcache::cli::RunCli(argc, argv); }
