#include "service/server.h"

int main(int argc, char** argv) { return ctxcache::service::RunCtxcached(argc, argv); }
